"""Sharded checkpoints: a ``torch.distributed.checkpoint`` folder that is never torn and loads without running code.

A sharded ``<name>.ckpt`` is a folder. torch's ``.metadata`` and one ``__<rank>_0.distcp`` file per rank hold
the tensors (weights and optimizer state, each rank its own shards); ``meta.pt`` holds everything else
(epoch, step, loops, callbacks, hyper-parameters, the optimizers' param groups), written by global rank 0
with ``torch.save``. Optimizer states are keyed by parameter name, so any number of ranks reads them.

*Atomic.* Every rank writes into a temp folder beside the checkpoint (``.<name>.<pid>.<random>.shards.tmp``,
which :mod:`src.engine.checkpointing.io` cleans up after a kill); once all have, global rank 0 adds ``meta.pt`` and swaps the
folder in with one rename: ``renameat2(RENAME_EXCHANGE)`` on Linux when an older checkpoint is there, then
deletes the old one. At every instant ``<name>`` is the old checkpoint or the new one, whole. Where the
kernel or filesystem has no exchange, the old one is renamed aside first (a kill in between leaves it
under its temp name, and ``<name>`` missing).

*No code runs while loading.* torch reads ``.metadata`` with ``pickle.load`` and non-tensor entries with
``torch.load(weights_only=False)``. Here ``.metadata`` is unpickled with a closed list of globals
(:func:`metadata_globals`), and a folder holding non-tensor entries is refused (this project writes none: they go
to ``meta.pt``, read with ``weights_only=True``).

:func:`read_sharded` assembles the full tensors in one process with no process group (``src/eval.py`` on
one device); :func:`load_sharded` reads into a live model's shards on any number of ranks.
"""

from __future__ import annotations

import contextlib
import copyreg
import ctypes
import dataclasses
import enum
import os
import pathlib
import shutil
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from src.engine.checkpointing.files import (
    TEMP_DIR_SUFFIX,
    cleanup_stale_temp_files,
    load_checkpoint_single_file,
    temp_prefix,
)
from src.engine.checkpointing.optimizer_state import indexed_optimizer_state
from src.engine.checkpointing.plain import plain_hyperparameters
from src.engine.utils.errors import CheckpointError
from src.engine.utils.safe_unpickle import RefusedGlobal, RestrictedUnpickler

META_FILE = "meta.pt"  # Lightning's name for it too (its ModelParallelStrategy's sharded checkpoints)
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's index of the shards
NON_TENSORS = "non_tensor_states"  # meta.pt key: the non-tensor parts of the weights and optimizer states


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    path = Path(path)
    return path.is_dir() and (path / DCP_METADATA).is_file()


# -- tensors for the shard files, the rest for meta.pt ---------------------------------------------------
def split_tensors(tree: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(tensor leaves, other leaves)`` of a nested dict, each keeping the nesting."""
    tensors: dict[str, Any] = {}
    rest: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            tensors[key], rest[key] = split_tensors(value)
        elif isinstance(value, torch.Tensor):
            tensors[key] = value
        else:
            rest[key] = value
    return tensors, rest


def join_tensors(tensors: dict[str, Any], rest: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`split_tensors`."""
    joined = dict(rest)
    for key, value in tensors.items():
        joined[key] = join_tensors(value, rest.get(key, {})) if isinstance(value, dict) else value
    return joined


def to_layout(checkpoint: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(tensors, meta)`` of a Lightning checkpoint whose optimizer states are keyed by parameter name."""
    meta = dict(checkpoint)
    states = {"state_dict": meta.pop("state_dict", {})}
    states |= {f"optimizer_{i}": s for i, s in enumerate(meta.pop("optimizer_states", []))}
    tensors, meta[NON_TENSORS] = split_tensors(states)
    return tensors, meta


def from_layout(tensors: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    """The Lightning checkpoint :func:`to_layout` split (optimizer states keyed by parameter name)."""
    meta = dict(meta)
    states = join_tensors(tensors, meta.pop(NON_TENSORS, {}))
    optimizers = sorted((k for k in states if k.startswith("optimizer_")), key=lambda k: int(k.split("_")[1]))
    return {**meta, "state_dict": states.get("state_dict", {}), "optimizer_states": [states[k] for k in optimizers]}


# -- reading .metadata without running code ---------------------------------------------------------------
class SafeReader(dcp.FileSystemReader):
    """torch's reader, with ``.metadata`` unpickled from a closed list of globals and tensor entries only."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / DCP_METADATA
        try:
            with open(path, "rb") as f:
                metadata = RestrictedUnpickler(f, metadata_globals()).load()
        except RefusedGlobal as err:
            raise CheckpointError(f"{path} names {err}, which a checkpoint index never holds, so it was not loaded; "
                                  "fix: use a checkpoint saved by this project") from None
        except Exception as err:
            raise CheckpointError(f"cannot read {path}: the checkpoint is corrupt or incomplete ({err}); fix: use "
                                  "another checkpoint, e.g. an epoch_*.ckpt beside it") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path} is not a torch.distributed.checkpoint index; fix: use a checkpoint "
                                  "saved by this project")
        others = [k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)]
        if others:
            raise CheckpointError(f"{self.path} holds non-tensor entries ({others[:3]}), which load as arbitrary "
                                  "Python objects, so it was not loaded; fix: use a checkpoint saved by this project")
        metadata.storage_meta = metadata.storage_meta or dcp.metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def saved_shapes(path: str | os.PathLike, prefix: str = "state_dict.") -> dict[str, tuple[int, ...]]:
    """``{key: shape}`` of the tensors saved under ``prefix`` (the weights), read from the index alone."""
    metadata = SafeReader(path).read_metadata()
    return {key.removeprefix(prefix): tuple(entry.size) for key, entry in metadata.state_dict_metadata.items()
            if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)}


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    return load_checkpoint_single_file(Path(path) / META_FILE)


def read_sharded(path: str | os.PathLike) -> dict[str, Any]:
    """The whole checkpoint in this process (no process group): full tensors, optimizer states in torch's
    format, as a single-file checkpoint of the same run would hold them."""
    reader = SafeReader(path)
    metadata = reader.read_metadata()
    flat = {key: torch.empty(entry.size, dtype=entry.properties.dtype)
            for key, entry in metadata.state_dict_metadata.items()}
    with warnings.catch_warnings():  # torch warns that it reads in one process: that is the point here
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load(flat, storage_reader=reader, no_dist=True)
    tensors: dict[str, Any] = {}
    for key, value in flat.items():  # the saved nesting, e.g. ("state_dict", "net.fc0.1.weight")
        *parents, leaf = metadata.planner_data[key]
        node = tensors
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    checkpoint = from_layout(tensors, read_meta(path))
    checkpoint["optimizer_states"] = [indexed_optimizer_state(s) for s in checkpoint["optimizer_states"]]
    return checkpoint


def load_sharded(targets: dict[str, Any], path: str | os.PathLike) -> None:
    """Read the saved tensors into ``targets`` (this rank's shards, any sharding), in place; every rank calls it."""
    dcp.load(targets, storage_reader=SafeReader(path))


# -- writing: a temp folder, then one rename ----------------------------------------------------------------
def save_sharded(tensors: dict[str, Any], meta: dict[str, Any], path: str | os.PathLike, is_global_zero: bool,
                 broadcast: Callable[[Any], Any], barrier: Callable[[], None]) -> None:
    """Every rank writes its shards of ``tensors``; global rank 0 adds ``meta`` and swaps the folder in."""
    path = Path(path)
    tmp = None
    if is_global_zero:
        path.parent.mkdir(parents=True, exist_ok=True)
        cleanup_stale_temp_files(path.parent)
        tmp = tempfile.mkdtemp(dir=path.parent, prefix=temp_prefix(path.name), suffix=TEMP_DIR_SUFFIX)
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it private (0700); a checkpoint folder is not
    tmp = Path(broadcast(tmp))
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True))
    if is_global_zero:  # dcp.save returns on rank 0 once every rank's files and the index are written
        with open(tmp / META_FILE, "wb") as f:
            torch.save(plain_hyperparameters(meta), f)  # loads back with weights_only=True
            f.flush()
            os.fsync(f.fileno())
        replace(tmp, path)
    barrier()


def _umask() -> int:
    umask = os.umask(0o022)  # read it by setting it, and put it back at once
    os.umask(umask)
    return umask


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux ``renameat2``); False where the kernel or filesystem cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    return renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0


def replace(src: Path, dest: Path) -> None:
    """Put ``src`` (a folder or a file) where ``dest`` is, atomically where the system allows; drop the old one."""
    if not dest.exists() and not dest.is_symlink():
        os.replace(src, dest)
    elif _exchange(src, dest):
        _remove(src)  # now the old checkpoint
    else:
        old = Path(tempfile.mkdtemp(dir=dest.parent, prefix=temp_prefix(dest.name), suffix=TEMP_DIR_SUFFIX))
        os.replace(dest, old / dest.name)
        os.replace(src, dest)
        _remove(old)
    with contextlib.suppress(OSError):
        fd = os.open(dest.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def metadata_globals() -> dict[tuple[str, str], Any]:
    """``(module, name) -> object`` for every global torch writes into a ``.metadata`` file: the dataclasses and
    enums of its checkpoint metadata and filesystem modules, ``torch.Size``, dtypes, layouts and memory formats,
    the function torch rebuilds a layout with, and paths. Nothing here runs code when called.

    Found by kind, not by name (torch's own reader unpickles with no list of globals): a class torch renames is
    still found, and nothing else of those modules is allowed."""
    found: dict[tuple[str, str], Any] = {}
    for module in (dcp_metadata, dcp_filesystem):
        for name, value in vars(module).items():
            if isinstance(value, type) and value.__module__ == module.__name__ and (
                    dataclasses.is_dataclass(value) or issubclass(value, enum.Enum)):
                found[(module.__name__, name)] = value
    rebuild_layout = copyreg.dispatch_table[torch.layout](torch.strided)[0]  # what torch pickles a layout with
    found[(rebuild_layout.__module__, rebuild_layout.__name__)] = rebuild_layout
    found[("torch", "Size")] = torch.Size
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype | torch.layout | torch.memory_format):
            found[("torch", name)] = value
    found[("pathlib", "PosixPath")] = found[("pathlib", "WindowsPath")] = found[("pathlib", "Path")] = pathlib.Path
    return found
