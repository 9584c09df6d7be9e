"""One-process runs stop on SIGTERM/SIGUSR1 like multi-process ones: save ``last.ckpt``, exit 128 + signal.

Lightning's own one-process stop raises after the batch with nothing saved and exit code 0. The
project's multi-process strategies install the agreed stop themselves (:mod:`src.engine.runtime.sigterm`);
this callback gives single-device trainers the same, checked after every batch (no collective).

Where a validation or the epoch's end follows the batch, the stop waits for them, as the periodic save
does: a checkpoint saved before them would make the resumed run skip them (Lightning fast-forwards a
validation due at the batch it resumes from, and never ends an epoch that it resumes at the end of).
:class:`~src.engine.checkpointing.last_checkpoint.LastCheckpoint`, the last callback to run there, makes the stop.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback

from src.engine.checkpointing.last_checkpoint import LastCheckpoint
from src.engine.runtime.sigterm import SigtermSync, install_stop_handlers, stop_for_preemption


class StopSignals(Callback):
    """On a one-process ``fit``: a SIGTERM or SIGUSR1 saves ``last.ckpt`` after the current batch (after the
    validation or the epoch's end that follows it, if any), then exits."""

    def __init__(self) -> None:
        self._sync: SigtermSync | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # runs before Lightning registers its handlers; multi-process strategies install their own
        self._sync = install_stop_handlers(trainer, 1, self._stop) if stage == "fit" and trainer.world_size == 1 else None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._sync is not None:
            self._sync()

    @staticmethod
    def _stop(trainer: L.Trainer, signum: int) -> None:
        # Without a LastCheckpoint (a hand-built Trainer that left it out) the stop is made at this batch.
        owner = next((cb for cb in trainer.callbacks if isinstance(cb, LastCheckpoint)), None)
        if owner is None:
            stop_for_preemption(trainer, signum)
        else:
            owner.stop_at_next_save_point(lambda: stop_for_preemption(trainer, signum))
