"""Run the project's entry points exactly as a user would: a fresh ``python src/<script>.py`` process."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.helpers.config import ROOT


def run_entry(script: str, *overrides: str, timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``python src/<script>.py overrides...`` as a user would; returns the completed process."""
    return subprocess.run(
        [sys.executable, str(ROOT / "src" / f"{script}.py"), *overrides],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT, env={**os.environ, **(env or {})},
    )
