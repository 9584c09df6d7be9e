"""Checkpoint files that are never torn, and checkpoint loads that run no code.

Lightning's ``TorchCheckpointIO`` saves through ``_atomic_save``: fsspec writes a temp file in
``$TMPDIR`` and ``shutil.move``\\ s it onto the checkpoint. When ``$TMPDIR`` is another filesystem
(tmpfs ``/tmp`` or ``/dev/shm``, a node-local disk under a network checkpoint dir) that move is a
truncating copy, so a kill during the copy (SIGKILL, OOM killer, preemption) leaves a torn or
0-byte ``last.ckpt`` in place of the good one, and the temp file leaks. :class:`AtomicCheckpointIO`
writes its temp file *in the destination directory*, fsyncs it, and ``os.replace``\\ s it onto the
checkpoint (an atomic rename on POSIX): at every instant the checkpoint is either the old file or
the new one, whole. Temp files a kill left behind are removed at the next save into that folder.

A save that runs out of space (ENOSPC, or a quota: EDQUOT) raises :class:`DiskFullError`, one line naming
the file, the bytes it needs and the bytes free, instead of torch's ``RuntimeError: [enforce fail at
inline_container.cc] ... unexpected pos``; the temp file is removed and the last good checkpoint stays.

Loads pass ``weights_only=True`` to ``torch.load`` unless the caller explicitly passes ``False``, or the
run trusts that file (``trust_checkpoint=true``, :func:`trust`): a checkpoint this project wrote holds tensors
and plain values (its hyper-parameters are made plain before the save: :mod:`src.engine.checkpointing.plain`), so a
crafted file can run no code while it is read.
"""

from __future__ import annotations

import contextlib
import errno
import inspect
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import CheckpointIO, TorchCheckpointIO
from lightning.pytorch.strategies import Strategy

from src.engine.checkpointing.files import (  # noqa: F401 - names of this module's interface
    _PATH,
    TEMP_DIR_SUFFIX,
    TEMP_SUFFIX,
    cleanup_stale_temp_files,
    load_checkpoint_single_file,
    temp_prefix,
    trust,
    trusted,
)
from src.engine.checkpointing.plain import plain_hyperparameters
from src.engine.checkpointing.sharded import is_sharded_checkpoint, read_sharded
from src.engine.utils.errors import CheckpointError


def _new_file_mode() -> int:
    """The mode ``open(path, "w")`` would give a new file (mkstemp makes 0o600), from this process's umask."""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as status:
        for line in status:
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    umask = os.umask(0o022)  # no /proc: read it by setting it (and put it back at once)
    os.umask(umask)
    return 0o666 & ~umask


def _fsync_dir(dirpath: Path) -> None:
    """Make the rename itself durable (best effort: some filesystems refuse to fsync a directory)."""
    try:
        fd = os.open(dirpath, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _is_local(path: _PATH) -> bool:
    text = str(path)
    return "://" not in text or text.startswith("file://")


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` with atomic same-directory saves and ``weights_only`` loads.

    Remote paths (``s3://`` and other fsspec URLs) are saved by Lightning's own code. Set as every
    trainer's default by ``configs/trainer/default.yaml`` (``plugins``).
    """

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None
    ) -> None:
        checkpoint = plain_hyperparameters(checkpoint)  # so the file loads back with weights_only=True
        if storage_options is not None or not _is_local(path):
            super().save_checkpoint(checkpoint, path, storage_options)  # raises on storage_options
            return
        dest = Path(str(path).removeprefix("file://"))
        dest.parent.mkdir(parents=True, exist_ok=True)
        cleanup_stale_temp_files(dest.parent)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=temp_prefix(dest.name), suffix=TEMP_SUFFIX)
        try:
            with os.fdopen(fd, "wb") as f:
                os.fchmod(f.fileno(), _new_file_mode())
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, dest)
        except BaseException as err:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            if disk_full(err):
                raise DiskFullError(dest, serialized_size(checkpoint), free_bytes(dest.parent)) from None
            raise
        _fsync_dir(dest.parent)

    def load_checkpoint(
        self,
        path: _PATH,
        map_location: Callable | None = lambda storage, loc: storage,
        weights_only: bool | None = True,
    ) -> dict[str, Any]:
        """``torch.load(..., weights_only=True)``; ``None`` (what ``trainer.fit`` passes by default) means ``True``.

        Only an explicit ``weights_only=False`` (``trainer.fit(..., weights_only=False)``, for a file you
        trust) unpickles arbitrary objects. Local files go through :func:`load_checkpoint_file`.
        """
        weights_only = weights_only is not False and not trusted(path)
        if not _is_local(path):
            return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        return load_checkpoint_file(str(path).removeprefix("file://"), map_location, weights_only)


class DiskFullError(CheckpointError):
    """A checkpoint did not fit on its filesystem; the previous checkpoint file is untouched."""

    def __init__(self, path: Path, needed: int, free: int) -> None:
        super().__init__(
            f"no space left to save checkpoint {path}: it needs {needed} bytes ({needed / 2**20:.1f} MiB) and "
            f"{free} bytes ({free / 2**20:.1f} MiB) are free there; the last good checkpoint is kept; fix: free "
            "space on that filesystem, or put the run on a larger one (paths.log_dir=... or hydra.run.dir=...)"
        )
        self.path, self.needed, self.free = path, needed, free


_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def disk_full(err: BaseException) -> bool:
    """True when ``err`` comes from a write that found no space: torch wraps the ``OSError`` in a RuntimeError."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _DISK_FULL:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


class _ByteCounter:
    """A write-only file that keeps only the number of bytes written to it."""

    def __init__(self) -> None:
        self.size = 0

    def write(self, data: bytes) -> int:
        self.size += memoryview(data).nbytes
        return memoryview(data).nbytes

    def flush(self) -> None:
        pass


def serialized_size(checkpoint: dict[str, Any]) -> int:
    """The bytes ``torch.save(checkpoint)`` writes, without writing them (serialized again: only after a failure)."""
    counter = _ByteCounter()
    torch.save(checkpoint, counter)
    return counter.size


def free_bytes(directory: Path) -> int:
    """Bytes an unprivileged process may still write on ``directory``'s filesystem."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def atomic_by_default(io: CheckpointIO | None) -> CheckpointIO:
    """``io``, or :class:`AtomicCheckpointIO` where none was given; fills an empty wrapper (``AsyncCheckpointIO()``).

    For a strategy's ``checkpoint_io`` getter, so ``Strategy()`` defaults to atomic saves without setting
    ``checkpoint_io`` in ``__init__`` (the Trainer refuses a strategy's checkpoint_io next to ``plugins``).
    """
    if io is None:
        return AtomicCheckpointIO()
    if getattr(io, "checkpoint_io", "absent") is None:  # a wrapping IO with no base IO yet
        io.checkpoint_io = AtomicCheckpointIO()
    return io


class AtomicCheckpointIODefault:
    """Strategy mixin (list it before Lightning's strategy class): ``checkpoint_io`` defaults to
    :class:`AtomicCheckpointIO` instead of Lightning's ``TorchCheckpointIO``; one passed in or set by the
    Trainer's ``plugins`` is kept (the Trainer hands either to the ``checkpoint_io`` setter). Lightning's own getter
    and setter keep its slot: its setter is called with the same IO, so what Lightning reads there agrees."""

    _checkpoint_io_given: CheckpointIO | None = None  # passed to __init__ or set since; None: the atomic default

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # the checkpoint_io argument of Lightning's __init__ (the next one in the MRO), however it was passed
        given = inspect.signature(super().__init__).bind(*args, **kwargs).arguments.get("checkpoint_io")
        self._checkpoint_io_given = given

    @property
    def checkpoint_io(self) -> CheckpointIO:
        io = atomic_by_default(self._checkpoint_io_given)
        self.checkpoint_io = io
        return io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        self._checkpoint_io_given = io
        Strategy.checkpoint_io.fset(self, io)  # Lightning's setter, for what it reads from its own slot


def load_checkpoint_file(path: _PATH, map_location: Any = "cpu", weights_only: bool = True) -> Any:
    """The one checkpoint loader: ``torch.load(path, weights_only=True)`` (no code runs while loading); a
    :class:`CheckpointError` of one line naming the problem and a fix. A sharded checkpoint (a folder, written by
    ``trainer=fsdp``) is read whole into this process, as the single file of the same run would be
    (:mod:`src.engine.checkpointing.files` reads a file, :mod:`src.engine.checkpointing.sharded` a folder).
    """
    if Path(path).exists() and is_sharded_checkpoint(Path(path)):  # tensors only (weights_only)
        return read_sharded(Path(path))
    return load_checkpoint_single_file(path, map_location=map_location, weights_only=weights_only)
