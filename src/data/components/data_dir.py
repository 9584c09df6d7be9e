"""The data directory a DataModule writes into: checked before any rank starts, filled so that no reader sees half
a file."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from src.engine import DataError


def check_writable_dir(path: str | Path, what: str) -> None:
    """Create ``path`` (with its parents) and write a probe file there; a :class:`DataError` naming the fix if not.

    A real attempt, not ``os.access``: root passes ``os.access`` on read-only mounts and in ``/proc``.
    ``what`` names the files that go there, for the message.
    """
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        reason = err.strerror or type(err).__name__
        raise DataError(
            f"cannot write {what} into {path} ({reason}); fix: set paths.data_dir to a directory you can "
            "write (it is created if missing), e.g. paths.data_dir=./data"
        ) from None


def publish_whole(root: str | Path, make: Callable[[Path], None], names: Sequence[str]) -> None:
    """Run ``make(folder)`` in a temporary folder inside ``root``, then rename each of ``names`` (paths relative to
    that folder: files or folders) to the same place under ``root``.

    A rename within one file system is atomic, so another process sharing ``root`` (a sweep's parallel jobs, test
    workers, the ranks of another node on a shared disk) finds each name whole or not at all, never a half-written
    download or extraction. A folder that another process published first is kept as it is.
    """
    root = Path(root)
    created = [p for p in (root, *root.parents) if not p.exists()]  # removed again if nothing is published
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".partial-", dir=root, ignore_cleanup_errors=True) as partial:
        try:
            make(Path(partial))
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            for folder in created:  # a refused or failed download leaves no folder it made
                with contextlib.suppress(OSError):
                    folder.rmdir()
            raise
        for name in names:
            target = root / name
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.replace(Path(partial) / name, target)  # a file replaces one there; a folder only an empty one
            except OSError:
                if not (target.is_dir() and any(target.iterdir())):
                    raise
