"""A rank that fails while its peers are healthy, and takes a while to exit (as a logger's finish does)."""

from __future__ import annotations

import os
import socket
import time

import lightning as L
import psutil


class FailingRank(L.Callback):
    """Global rank ``rank`` fails at training batch ``at``: its connections close at once, and it raises
    ``exit_s`` later, so its peers see it gone well before its launcher sees it end."""

    def __init__(self, rank: int = 1, at: int = 2, exit_s: float = 3.0) -> None:
        self.rank, self.at, self.exit_s = rank, at, exit_s

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if trainer.global_rank == self.rank and batch_idx == self.at:
            for connection in psutil.Process().net_connections(kind="tcp"):
                if connection.status == psutil.CONN_ESTABLISHED:
                    with socket.socket(fileno=os.dup(connection.fd)) as sock:
                        sock.shutdown(socket.SHUT_RDWR)  # the socket itself, not only this copy of its fd
            time.sleep(self.exit_s)
            raise RuntimeError(f"the failure of rank {self.rank}")
