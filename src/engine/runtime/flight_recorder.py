"""torch's flight recorder: each rank's ring of its last collectives, turned on before the group exists and read
when a rank is stuck.

torch reads the record out publicly through its control plane: ``torch.distributed.elastic.control_plane.worker_main``
serves the process's debug handlers on a Unix socket, ``fr_trace_json`` among them. :func:`dump` starts that server
for one request and stops it: nothing listens while the run is healthy. The record is torch's JSON (``entries``:
group, sequence number, sizes, state of each collective; ``pg_status``: each group's last collectives).
"""

from __future__ import annotations

import http.client
import os
import socket
import tempfile
from pathlib import Path

from torch.distributed.elastic.control_plane import TORCH_WORKER_SERVER_SOCKET, worker_main

BUFFER_SIZE = "2000"  # collectives kept per rank
HANDLER = "/handler/fr_trace_json"  # the worker server's route for the record of every backend but NCCL's own
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
        self.sock.settimeout(TIMEOUT_S)
        self.sock.connect(self.path)


def dump() -> bytes:
    """This process's record of its collectives, as torch's JSON; raises ``OSError`` when the server cannot answer."""
    with tempfile.TemporaryDirectory(prefix="fr-") as folder:
        path = os.path.join(folder, "worker.sock")  # short: a Unix socket path holds about 100 bytes
        before = os.environ.get(TORCH_WORKER_SERVER_SOCKET)
        os.environ[TORCH_WORKER_SERVER_SOCKET] = path  # where worker_main listens
        try:
            with worker_main():
                connection = _UnixHTTPConnection(path)
                try:
                    connection.request("POST", HANDLER)
                    response = connection.getresponse()
                    body = response.read()
                finally:
                    connection.close()
        finally:
            if before is None:
                os.environ.pop(TORCH_WORKER_SERVER_SOCKET, None)
            else:
                os.environ[TORCH_WORKER_SERVER_SOCKET] = before
    if response.status != 200:
        raise OSError(f"torch's worker server answered {response.status} for {HANDLER}: {body[:200]!r}")
    return body
