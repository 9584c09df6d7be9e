"""The data directory a DataModule writes into: checked before any rank starts."""

from __future__ import annotations

import tempfile
from pathlib import Path

from src.utils.errors import DataError


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
