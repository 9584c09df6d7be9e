"""Keep Lightning's epoch counters right when a run resumes from an epoch's last batch.

Without it, a run resumed from a checkpoint written on the last training batch of an epoch skips
``on_train_epoch_start`` for the next epoch. It also saves epoch counters that make a second
resume repeat an epoch: the final weights then differ from an uninterrupted run's. The fix itself
is in :func:`src.strategies.lightning_compat.end_restart_on_last_batch`; this callback calls it for
any strategy.
"""

from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import Callback

from src.strategies.lightning_compat import end_restart_on_last_batch
from src.utils.pylogger import RankedLogger

log = RankedLogger(__name__)


class EpochRestartFix(Callback):
    """At ``on_train_start`` of a resumed fit, end the restart stage that Lightning keeps too long."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if end_restart_on_last_batch(trainer):
            log.info(f"Resumed at the end of epoch {trainer.current_epoch - 1}: "
                     f"epoch {trainer.current_epoch} starts afresh")
