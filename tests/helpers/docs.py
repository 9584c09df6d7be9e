"""The README and docs/ as tests read them: which files, and the commands in their bash code blocks."""

from __future__ import annotations

import re

from tests.helpers.config import ROOT

DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND = re.compile(r"^(?:[A-Z_]+=\S+ )*(?:python src/(?:train|eval|export|predict)\.py|torchrun .*(?:src/train\.py|-m src\.engine\.collectives)"
                     r"|srun python src/train\.py|python -m (?:src\.engine\.collectives|scripts\.bench|pytest)|make)\b")


def readme_commands() -> list[str]:
    """The runnable lines of the bash code blocks of the README and docs/, continuation lines joined, comments
    dropped."""
    commands = []
    for document in DOCUMENTS:
        for block in re.findall(r"^```(?:bash|sh)?\n(.*?)^```", document.read_text(), re.S | re.M):
            for line in block.replace("\\\n", " ").splitlines():
                line = " ".join(re.sub(r"(^|\s)#.*$", "", line).split())
                if COMMAND.match(line):
                    commands.append(line)
    return list(dict.fromkeys(commands))  # `make test` appears more than once


def docs_command(start: str) -> str:
    """The one command of the README and docs/ that starts with ``start``, as written. A test that runs it for
    tests/test_readme_commands.py (RUN_ELSEWHERE) runs what the docs say, and follows them when they change."""
    (command,) = [c for c in readme_commands() if c.startswith(start)]
    return command


def assert_no_error_line(stderr: str) -> None:
    """A docs command that ran as written printed no ``error: ...`` line (the project's one-line refusals)."""
    assert not re.search(r"^error:", stderr, re.M), stderr[-3000:]
