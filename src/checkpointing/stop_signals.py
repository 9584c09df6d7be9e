"""One-process runs stop on SIGTERM/SIGUSR1 like multi-process ones: save ``last.ckpt``, exit 128 + signal.

Lightning's own one-process stop raises after the batch with nothing saved and exit code 0. The
project's multi-process strategies install the agreed stop themselves (:mod:`src.runtime.sigterm`);
this callback gives single-device trainers the same, checked after every batch (no collective).
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback

from src.runtime.sigterm import SigtermSync, install_stop_handlers


class StopSignals(Callback):
    """On a one-process ``fit``: a SIGTERM or SIGUSR1 saves ``last.ckpt`` after the current batch, then exits."""

    def __init__(self) -> None:
        self._sync: SigtermSync | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # runs before Lightning registers its handlers; multi-process strategies install their own
        self._sync = install_stop_handlers(trainer, 1) if stage == "fit" and trainer.world_size == 1 else None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._sync is not None:
            self._sync()
