"""Shows whether a process ran the interpreter's teardown: :func:`hold` an object that only the teardown frees.

The object lives in this module's globals. A module still referenced at exit has its globals cleared by the
teardown (a module of the running function may not be: its globals live on in the function), so it is here.
"""

from __future__ import annotations

import os
from pathlib import Path


class _WritesWhenFreed:
    """Writes to its file when freed. By then module globals such as ``os`` may be gone: it holds what it calls."""

    def __init__(self, path: Path) -> None:
        self.fd, self.write = os.open(path, os.O_WRONLY | os.O_CREAT), os.write

    def __del__(self) -> None:
        self.write(self.fd, b"freed")


_HELD: list[_WritesWhenFreed] = []


def hold(path: Path) -> None:
    """Create ``path`` empty; the teardown of this process writes ``freed`` into it."""
    _HELD.append(_WritesWhenFreed(path))
