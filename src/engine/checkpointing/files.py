"""Checkpoint files on disk: the temp names of atomic saves (and their cleanup), trusted files, and the loader of
one checkpoint file. :mod:`src.engine.checkpointing.io` (saves, and the loader of any checkpoint) and
:mod:`src.engine.checkpointing.sharded` (a folder of shards) both build on this module.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from src.engine.utils.errors import CheckpointError

_PATH = str | os.PathLike

TEMP_SUFFIX = ".tmp"
TEMP_DIR_SUFFIX = ".shards.tmp"  # the temp folder of a sharded checkpoint (src/engine/checkpointing/sharded.py)
# ``.<checkpoint name>.<pid>.<8 random chars>.tmp``: tempfile.mkstemp's random part is 8 of [a-z0-9_].
_TEMP_NAME = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)\.[a-z0-9_]{8}" + re.escape(TEMP_SUFFIX) + r"$")
_TEMP_DIR_NAME = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)\.[a-z0-9_]{8}" + re.escape(TEMP_DIR_SUFFIX) + r"$")


def temp_prefix(checkpoint_name: str) -> str:
    """The prefix of this process's temp files for ``checkpoint_name`` (the suffix is :data:`TEMP_SUFFIX`)."""
    return f".{checkpoint_name}.{os.getpid()}."


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # saves are synchronous: a temp file of ours is a leftover of a failed save
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists but is another user's
        return True
    return True


def cleanup_stale_temp_files(dirpath: _PATH) -> list[Path]:
    """Remove the temp files of :class:`AtomicCheckpointIO` (and temp folders of sharded checkpoints) that a killed
    save left in ``dirpath``.

    Only names of the exact schemes ``.<name>.<pid>.<random>.tmp`` (files) and ``.<name>.<pid>.<random>.shards.tmp``
    (folders) are touched, and only when the process
    ``<pid>`` is gone (or is this one), so a save in progress in another process on this machine is left
    alone. Returns the removed paths.
    """
    removed: list[Path] = []
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for entry in os.scandir(dirpath):
            is_dir = entry.is_dir(follow_symlinks=False)
            match = (_TEMP_DIR_NAME if is_dir else _TEMP_NAME).match(entry.name)
            if match is None or not (is_dir or entry.is_file(follow_symlinks=False)) or _alive(int(match["pid"])):
                continue
            if is_dir:  # a sharded checkpoint's temp folder (src/engine/checkpointing/sharded.py)
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(Path(entry.path))
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
                removed.append(Path(entry.path))
    return removed


_TRUSTED: set[str] = set()


def _key(path: _PATH) -> str:
    text = str(path).removeprefix("file://")
    return text if "://" in text else os.path.realpath(text)


def trust(path: _PATH) -> None:
    """Let this process unpickle any object in ``path`` (``trust_checkpoint=true``): for a file you trust."""
    _TRUSTED.add(_key(path))


def trusted(path: _PATH) -> bool:
    return _key(path) in _TRUSTED


def load_checkpoint_single_file(path: _PATH, map_location: Any = "cpu", weights_only: bool = True) -> Any:
    """A checkpoint file: ``torch.load(path, weights_only=True)`` (no code runs while loading); a
    :class:`CheckpointError` of one line naming the problem and a fix (:func:`src.engine.checkpointing.io.load_checkpoint_file`
    also reads sharded checkpoints).

    torch's own messages span many lines, and for a file it cannot unpickle suggest ``weights_only=False``,
    which would let a crafted file run code: never the fix here. ``weights_only=False`` is for a caller
    that trusts the file (an explicit ``trainer.fit(..., weights_only=False)``).
    """
    path = Path(path)
    shown = f"ckpt_path={str(path)!r}"
    if not path.exists():
        raise CheckpointError(f"{shown} does not exist; fix: pass the path of a .ckpt file")
    if path.is_dir():
        inside = sorted(p.name for p in path.glob("*.ckpt"))[:3]
        example = path / (inside[0] if inside else "last.ckpt")
        holds = f" (it holds {', '.join(inside)})" if inside else ""
        raise CheckpointError(
            f"{shown} is a directory, not a checkpoint file{holds}; fix: pass a file, e.g. "
            f"ckpt_path={example}"
        )
    if not path.is_file():
        raise CheckpointError(f"{shown} is not a regular file; fix: pass the path of a .ckpt file")
    if not os.access(path, os.R_OK):
        raise CheckpointError(f"{shown} is not readable; fix: check its permissions")
    if path.stat().st_size == 0:
        raise CheckpointError(
            f"checkpoint {path} is empty (0 bytes; its save was cut short); fix: use another "
            f"checkpoint, e.g. an epoch_*.ckpt beside it, or train again"
        )
    weights_only = weights_only and not trusted(path)
    try:
        return torch.load(path, map_location=map_location, weights_only=weights_only)
    except pickle.UnpicklingError as err:
        detail = _unpickling_detail(str(err))
        if detail.lower().startswith(("unsupported global", "trying to load unsupported global")):
            raise CheckpointError(
                f"{path} holds Python objects other than tensors and plain values ({detail}), and loading them "
                "could run code, so it was not loaded (this project's own checkpoints hold none); fix: if you "
                "trust the file, pass trust_checkpoint=true"
            ) from None
        raise CheckpointError(
            f"cannot read checkpoint {path}: the file is corrupt or not a PyTorch checkpoint "
            f"({detail}); fix: use another checkpoint, e.g. an epoch_*.ckpt beside it"
        ) from None
    except Exception as err:
        detail = _first_sentence(str(err)) or type(err).__name__
        raise CheckpointError(
            f"cannot read checkpoint {path}: the file is corrupt or truncated ({detail}); "
            "fix: use another checkpoint, e.g. an epoch_*.ckpt beside it"
        ) from None


def _unpickling_detail(message: str) -> str:
    """The reason inside torch's weights-only unpickling message, without its advice."""
    _, found, after = message.partition("WeightsUnpickler error:")
    if not found:  # a global of a blocked module (os, posix, subprocess...) is named on a line of its own
        after = next((line for line in message.splitlines() if "unsupported GLOBAL" in line), message)
    return _first_sentence(after) or "unreadable pickle data"


def _first_sentence(message: str) -> str:
    first = next((line.strip() for line in message.splitlines() if line.strip()), "")
    return first.split(". ")[0].rstrip(".")[:200]
