"""One-node runs rendezvous through a file, and gloo listens on loopback only: nothing on outside interfaces.

torch's TCPStore server, which Lightning's launcher starts on rank 0 for ``env://``, listens on every
interface with no authentication, and gloo binds to the interface of the host name. For a run whose
ranks all live on this machine neither is needed: the launcher (:mod:`src.engine.strategies.launchers`)
picks a ``FileStore`` path in a fresh private temp dir, hands it to the ranks in the environment and
removes the dir once they have ended, and sets ``GLOO_SOCKET_IFNAME=lo`` unless the user chose an
interface. Multi-node runs and runs started by torchrun or SLURM keep the TCP rendezvous (they must be
reachable from the other nodes).
"""

from __future__ import annotations

import atexit
import datetime as dt
import ipaddress
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from src.engine.runtime.launch_context import launch_context

STORE_ENV = "LIGHTNING_HYDRA_TEMPLATE_FILE_STORE"
RANKS_EXIT_WAIT_S = 5.0  # at exit, how long the launcher waits for its ranks to end before it removes their store


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def prepare_local_store(num_nodes: int, fresh: bool, launches_ranks: bool,
                        ranks: Sequence[subprocess.Popen] = ()) -> None:
    """In the launcher, before the ranks start: a file store for a one-node run on loopback.

    Only a process that starts the ranks itself (``launches_ranks``: not under torchrun, SLURM, or as a
    child rank) picks the path; the ranks it starts inherit it.

    ``fresh``: every launch starts new processes (spawn), so each gets a new file. Otherwise (popen) the
    ranks live across fit and test and keep their group: the path is made once, and the child ranks,
    which inherit it and run this launcher's code too, keep it.

    ``ranks``: the processes this launch will start (the launcher's own list, filled later). At exit the
    folder is removed once they have ended.
    """
    if not launches_ranks or num_nodes != 1 or not _loopback(launch_context().master_addr or "127.0.0.1"):
        return
    if STORE_ENV in os.environ and not fresh:
        return
    directory = tempfile.mkdtemp(prefix="ddp-store-")  # mode 0700: other users cannot join or read it
    atexit.register(remove_when_ranks_end, directory, ranks)
    os.environ[STORE_ENV] = str(Path(directory) / "store")
    if "lo" in dict(socket.if_nameindex()).values():
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def remove_when_ranks_end(directory: str, ranks: Sequence[subprocess.Popen]) -> bool:
    """Remove the store's folder once every process in ``ranks`` has ended (a bounded wait); return whether it did.

    FileStore deletes its file when its last user closes it, but ranks end without closing it (they skip the
    interpreter's teardown: :mod:`src.engine.runtime.prompt_exit`), so the launcher removes it. A rank that is
    still running keeps it: deleting the file under a live rank would hang its store calls.
    """
    deadline = time.monotonic() + RANKS_EXIT_WAIT_S
    for rank in ranks:
        try:
            rank.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return False
    shutil.rmtree(directory, ignore_errors=True)
    return True


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
