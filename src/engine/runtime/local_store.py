"""One-node runs rendezvous through a file, and gloo listens on loopback only: nothing on outside interfaces.

torch's TCPStore server, which Lightning's launcher starts on rank 0 for ``env://``, listens on every
interface with no authentication, and gloo binds to the interface of the host name. For a run whose
ranks all live on this machine neither is needed: the launcher (:mod:`src.engine.utils.lightning_compat`)
picks a ``FileStore`` path in a fresh private temp dir and hands it to the ranks in the environment,
and sets ``GLOO_SOCKET_IFNAME=lo`` unless the user chose an interface. Multi-node runs and runs started
by torchrun or SLURM keep the TCP rendezvous (they must be reachable from the other nodes).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime as dt
import ipaddress
import os
import socket
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from src.engine.runtime.launch_context import launch_context

STORE_ENV = "LIGHTNING_HYDRA_TEMPLATE_FILE_STORE"


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def prepare_local_store(num_nodes: int, fresh: bool, launches_ranks: bool) -> None:
    """In the launcher, before the ranks start: a file store for a one-node run on loopback.

    Only a process that starts the ranks itself (``launches_ranks``: not under torchrun, SLURM, or as a
    child rank) picks the path; the ranks it starts inherit it.

    ``fresh``: every launch starts new processes (spawn), so each gets a new file. Otherwise (popen) the
    ranks live across fit and test and keep their group: the path is made once, and the child ranks,
    which inherit it and run this launcher's code too, keep it.
    """
    if not launches_ranks or num_nodes != 1 or not _loopback(launch_context().master_addr or "127.0.0.1"):
        return
    if STORE_ENV in os.environ and not fresh:
        return
    directory = tempfile.mkdtemp(prefix="ddp-store-")  # mode 0700: other users cannot join or read it
    # FileStore deletes its file when its last rank closes it; ranks may outlive this process, so only
    # an empty directory is removed here (deleting the file under a live rank would hang its store calls)
    atexit.register(_remove_if_empty, directory)
    os.environ[STORE_ENV] = str(Path(directory) / "store")
    if "lo" in dict(socket.if_nameindex()).values():
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def _remove_if_empty(directory: str) -> None:
    with contextlib.suppress(OSError):
        os.rmdir(directory)


def local_store_path() -> str | None:
    """The file store the launcher made for this launch's ranks (None: none, e.g. several nodes)."""
    return os.environ.get(STORE_ENV)


def init_group_with_local_store(backend: str, timeout: dt.timedelta, device: torch.device, rank: int,
                                world_size: int) -> dist.Store | None:
    """In each rank: start the default group on the launcher's file store and return it; None when there is none."""
    path = local_store_path()
    if not path or dist.is_initialized():
        return None
    store = dist.FileStore(path, world_size)
    store.set_timeout(timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                            device_id=device if device.type != "cpu" else None)
    return store
