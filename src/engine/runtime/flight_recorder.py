"""torch's flight recorder: each rank's ring of its last collectives, turned on before the group exists and written
out when a rank is stuck.

torch reads the record out publicly through its control plane: ``torch.distributed.elastic.control_plane.worker_main``
serves the process's debug handlers on a Unix socket. :func:`dump` starts that server for its requests and stops
it: nothing listens while the run is healthy. A record is torch's JSON (``entries``: group, sequence number, sizes,
state of each collective; ``pg_status``: each group's last collectives). NCCL keeps a ring of its own.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import tempfile
from pathlib import Path

from torch.distributed.elastic.control_plane import TORCH_WORKER_SERVER_SOCKET, worker_main

BUFFER_SIZE = "2000"  # collectives kept per rank
COLLECTIVES = "fr_trace_json"  # the worker server's handler for the ring of every backend but NCCL
NCCL = "dump_nccl_trace_json"  # NCCL's ring (no "entries" where NCCL made no group)
TIMEOUT_S = 10.0


def record_collectives(backend: str, folder: str | os.PathLike) -> None:
    """Turn the recorder on before the process group is made (torch reads these when it makes the group).

    Every backend: what :func:`dump` reads when a rank is stuck. NCCL also dumps its own ring when a collective
    times out (``TORCH_NCCL_DUMP_ON_TIMEOUT``), to ``<folder>/rank_<N>`` (``TORCH_FR_DUMP_TEMP_FILE``). Values the
    user set win.
    """
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", BUFFER_SIZE)
    if backend == "nccl":
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(Path(folder) / "rank_"))
        Path(folder).mkdir(parents=True, exist_ok=True)


class _UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP over the Unix socket the worker server listens on."""

    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=TIMEOUT_S)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.path)


def write(folder: str | os.PathLike, rank: int) -> list[Path]:
    """Write this rank's record to ``<folder>/rank_<rank>.json``, and NCCL's ring, where it has one, to
    ``rank_<rank>.nccl.json``: the files written."""
    collectives, nccl = dump(COLLECTIVES, NCCL)
    records = {f"rank_{rank}.json": collectives}
    if "entries" in json.loads(nccl):
        records[f"rank_{rank}.nccl.json"] = nccl
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name, record in records.items():
        (folder / name).write_bytes(record)
    return [folder / name for name in records]


def dump(*handlers: str) -> list[bytes]:
    """What each of the worker server's ``handlers`` answers in this process; ``OSError`` when one cannot answer."""
    with tempfile.TemporaryDirectory(prefix="fr-", dir=_short_temp_dir()) as folder:
        path = os.path.join(folder, "worker.sock")
        before = os.environ.get(TORCH_WORKER_SERVER_SOCKET)
        os.environ[TORCH_WORKER_SERVER_SOCKET] = path  # where worker_main listens
        try:
            with worker_main():
                return [_ask(path, handler) for handler in handlers]
        finally:
            if before is None:
                os.environ.pop(TORCH_WORKER_SERVER_SOCKET, None)
            else:
                os.environ[TORCH_WORKER_SERVER_SOCKET] = before


def _ask(path: str, handler: str) -> bytes:
    connection = _UnixHTTPConnection(path)
    try:
        connection.request("POST", f"/handler/{handler}")
        response = connection.getresponse()
        body = response.read()
    finally:
        connection.close()
    if response.status != 200:
        raise OSError(f"torch's worker server answered {response.status} for {handler}: {body[:200]!r}")
    return body


def _short_temp_dir() -> str | None:
    """The temporary folder, unless its path is too long for a Unix socket (about 100 bytes: a job's own
    ``TMPDIR`` may be): then /tmp."""
    return None if len(tempfile.gettempdir()) < 64 else "/tmp"
