"""Hydra callbacks that run before Hydra creates the job's output directory."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


def unwritable_reason(directory: Path) -> str | None:
    """Why ``directory`` cannot be created or written, or None when it can."""
    probe = directory.absolute()
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is a file, not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable"
    return None


class OutputDirCheck(Callback):
    """Stop with one line when the run or sweep directory cannot be created, before anything is written."""

    def _check(self, directory: str) -> None:
        reason = unwritable_reason(Path(directory))
        if reason:
            print(f"error: cannot create output dir {directory}: {reason}; choose another with "
                  "hydra.run.dir=... (or paths.log_dir=...)", file=sys.stderr, flush=True)
            raise SystemExit(2)

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check(config.hydra.run.dir)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check(config.hydra.sweep.dir)
