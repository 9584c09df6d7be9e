"""A test callback that keeps a copy of ``last.ckpt`` as it was at a given step, before later saves replace it."""

from __future__ import annotations

import shutil
from pathlib import Path

from lightning import Callback, LightningModule, Trainer


class CopyLastCheckpoint(Callback):
    """At the start of the batch after global step ``step``, rank 0 copies ``<run dir>/checkpoints/last.ckpt``
    (a periodic save made at that step) to ``dest``."""

    def __init__(self, step: int, dest: str) -> None:
        self.step, self.dest = step, Path(dest)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        if trainer.global_step == self.step and trainer.is_global_zero and not self.dest.exists():
            shutil.copy(Path(trainer.default_root_dir) / "checkpoints" / "last.ckpt", self.dest)
