"""Keep Lightning's epoch counters right when a run resumes from an epoch's last batch.

Without it, a run resumed from a checkpoint written on the last training batch of an epoch skips
``on_train_epoch_start`` for the next epoch. It also saves epoch counters that make a second
resume repeat an epoch: the final weights then differ from an uninterrupted run's. The fix itself
is :func:`end_restart_on_last_batch` (public Lightning names only); this callback calls it for any strategy.
"""

from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import Callback

from src.engine.utils.pylogger import RankedLogger

log = RankedLogger(__name__)


def end_restart_on_last_batch(trainer: L.Trainer) -> bool:
    """Work around a Lightning 2.6 restart bug; True when it applied.

    Resuming from a checkpoint saved in ``on_train_batch_end`` of an epoch's last batch (a periodic
    or preemption checkpoint), the fit loop's ``reset`` finishes that epoch but keeps its
    ``restarted_mid_epoch`` stage for the whole next epoch. That epoch is then never counted as
    started, and ``on_train_epoch_start`` is skipped. A checkpoint taken in that epoch holds
    counters that a second resume reads as "epoch finished": that epoch runs again. Call this at
    ``on_train_start``, after ``reset`` and before the next epoch begins. Every name it uses is
    public.
    """
    loop = trainer.fit_loop
    if loop.restarted_mid_epoch and loop.epoch_loop.batch_progress.is_last_batch:
        loop.reset_restart_stage()
        return True
    return False


class EpochRestartFix(Callback):
    """At ``on_train_start`` of a resumed fit, end the restart stage that Lightning keeps too long."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if end_restart_on_last_batch(trainer):
            log.info(f"Resumed at the end of epoch {trainer.current_epoch - 1}: "
                     f"epoch {trainer.current_epoch} starts afresh")
