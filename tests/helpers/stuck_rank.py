"""A rank that gets stuck while its threads live, for the watchdog's tests (added with a `+callbacks.` override).

``how="collective"``: it enters an all-reduce on a group of both ranks that the other rank never joins;
``how="call"``: its main thread blocks in a C call (a read from a pipe nobody writes). Its heartbeat thread
beats on in both cases. It writes ``<run dir>/stuck`` just before.
"""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback


class StuckRank(Callback):
    def __init__(self, rank: int = 1, at_step: int = 10, how: str = "collective") -> None:
        self.rank, self.at_step, self.how = rank, at_step, how
        self.group = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit" and self.how == "collective":
            self.group = dist.new_group(backend="gloo")  # every rank makes it; only one will use it

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if trainer.global_rank != self.rank or trainer.global_step != self.at_step:
            return
        (Path(trainer.default_root_dir) / "stuck").write_text(str(os.getpid()))
        if self.how == "collective":
            dist.all_reduce(torch.ones(1), group=self.group)  # the other rank never joins
        else:
            read_end, _ = os.pipe()
            os.read(read_end, 1)  # nothing is ever written
