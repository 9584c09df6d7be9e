"""``try_lock``: an exclusive, non-blocking ``flock`` on a file, held for as long as its descriptor is open.

Run directories and search directories are claimed this way: the kernel drops the lock when the
process dies, so a killed owner never leaves a stale lock behind (unlike a marker file).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


def try_lock(path: str | os.PathLike) -> int | None:
    """Open (or create) ``path`` and lock it; the open descriptor, or None when another process holds it."""
    fd = os.open(Path(path), os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd
