"""Lightning's rich progress bar, updated at its refresh rate instead of on every training batch."""

from __future__ import annotations

import time

from lightning import LightningModule, Trainer
from lightning.pytorch.callbacks import RichProgressBar


class RateLimitedRichProgressBar(RichProgressBar):
    """``RichProgressBar`` whose training bar takes at most ``refresh_rate`` updates per second.

    Lightning's bar already redraws only ``refresh_rate`` times a second, but it still updates the
    task and recomputes the shown metrics on every batch, which the training step waits for. Skipped updates lose nothing: each update sets the absolute position,
    the epoch's last batch is always shown, and a skipped one is applied before validation starts.
    """

    def __init__(self, refresh_rate: int = 4, **kwargs) -> None:
        super().__init__(refresh_rate=refresh_rate, **kwargs)
        self._next_update = 0.0
        self._pending_batch_idx: int | None = None

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        self._next_update = 0.0
        self._pending_batch_idx = None

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        now = time.monotonic()
        if now < self._next_update and batch_idx + 1 < self.total_train_batches:  # the last batch always shows
            self._pending_batch_idx = batch_idx
            return
        self._next_update = now + 1.0 / max(self.refresh_rate, 1)
        self._pending_batch_idx = None
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def _apply_pending(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._pending_batch_idx is not None:  # the parent's hook reads neither outputs nor batch
            super().on_train_batch_end(trainer, pl_module, None, None, self._pending_batch_idx)
            self._pending_batch_idx = None

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._apply_pending(trainer, pl_module)  # validation within an epoch (val_check_interval < 1)
        super().on_validation_start(trainer, pl_module)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._apply_pending(trainer, pl_module)  # an epoch cut short (max_steps, a stop request)
        super().on_train_epoch_end(trainer, pl_module)

    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict:
        """Lightning's, less ``v_num``: the logger's version (0 for every run of this template, shown as 0.000)."""
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        return metrics
