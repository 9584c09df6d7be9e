"""``checkpoints/last.ckpt``: the checkpoint a killed, stopped or finished run resumes from.

Lightning 2.6's ModelCheckpoint writes ``last.ckpt`` at an epoch's end only when it also saved a top-k
file at that step: a run whose metric stopped improving, or that ended on ``max_steps`` between two
intervals, kept an older ``last.ckpt`` than its final state. :class:`LastCheckpoint` writes it every
``every_n_train_steps``, at the end of each training epoch (after its validation) and when ``fit``
ends, whatever the monitored metric did, and saves nothing else. A periodic save never falls between a step
and the validation due after it (a resume from there would skip that validation): it waits for the
validation's end, and on an epoch's last batch for the epoch's end. The epoch's training row reaches the
loggers before the epoch's save (:func:`src.utils.lightning_compat.log_training_epoch_now`). A one-process
stop signal noted at such a batch waits the same way (:meth:`LastCheckpoint.stop_after_this_batch`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn

from src.run.status import CHECKPOINT_DIR
from src.utils import lightning_compat as compat

LAST_NAME = f"{ModelCheckpoint.CHECKPOINT_NAME_LAST}{ModelCheckpoint.FILE_EXTENSION}"


class LastCheckpoint(ModelCheckpoint):
    """A ModelCheckpoint (so Lightning adds no default one) that owns ``<dirpath>/last.ckpt`` alone."""

    def __init__(self, dirpath: str | Path, every_n_train_steps: int = 1000) -> None:
        super().__init__(dirpath=dirpath, save_top_k=0, save_last=True, every_n_train_steps=every_n_train_steps,
                         enable_version_counter=False)
        self.every_n_steps = every_n_train_steps
        self._saved_step = -1
        self._after_validation = False  # a periodic save waits for the validation after its step
        self._stop: Callable[[], Any] | None = None  # a stop that waits for that validation, or the epoch's end

    @property
    def path(self) -> Path:
        return Path(self.dirpath) / LAST_NAME

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._saved_step = trainer.global_step  # a resumed fit holds that step already

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # also a save that waited for a validation which did not run (an empty validation set): made one step late
        due = self._after_validation or (self.every_n_steps and trainer.global_step % self.every_n_steps == 0)
        self._after_validation = False
        if not due:
            return
        # A save here, before the validation due after this batch, would make a resume skip that validation
        # (Lightning fast-forwards it): save after it. The epoch's last batch is saved at the epoch's end.
        if self._is_last_batch(trainer):
            return
        if compat.validation_follows(trainer):
            self._after_validation = True
        else:
            self.save(trainer)

    def stop_after_this_batch(self, trainer: L.Trainer, stop: Callable[[], Any]) -> bool:
        """Take over a stop noted in ``on_train_batch_end`` (``stop`` saves ``last.ckpt`` and ends the run).

        If a validation or the epoch's end follows this batch, ``stop`` runs in place of the save after them
        and this returns True; otherwise nothing waits, and the caller stops now. Should that validation not
        run (an empty validation set), the caller asks again at its next batch."""
        if not (self._is_last_batch(trainer) or compat.validation_follows(trainer)):
            return False
        self._stop = stop
        return True

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # The epoch's training row goes to the loggers before its checkpoint: a kill between the two would
        # leave a resume (from the epoch's end) that never logs it. Its synced metrics are computed on every
        # rank here, before the save's collectives: one order on every rank.
        compat.log_training_epoch_now(trainer)
        self._save_or_stop(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or self._is_last_batch(trainer):  # an epoch's last validation: its end saves
            return
        if self._after_validation or self._stop is not None:  # the save, or the stop, that waited for it
            self._after_validation = False
            self._save_or_stop(trainer)

    def _save_or_stop(self, trainer: L.Trainer) -> None:
        stop, self._stop = self._stop, None
        if stop is not None:
            stop()  # saves last.ckpt here and ends the run
        self.save(trainer)

    @staticmethod
    def _is_last_batch(trainer: L.Trainer) -> bool:
        return trainer.fit_loop.epoch_loop.batch_progress.is_last_batch

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for logger in trainer.loggers:  # what the run logged is on disk before the checkpoint that ends it
            logger.save()
        self.save(trainer, final=True)  # also after an epoch-end save: the loops now count that epoch as done

    def save(self, trainer: L.Trainer, final: bool = False) -> None:
        """Write ``last.ckpt`` on every rank's call (rank 0 writes): once per global step, and when fit ends."""
        if trainer.fast_dev_run or trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return
        if trainer.global_step == self._saved_step and not final:  # e.g. the epoch's end right after its step
            return
        trainer.save_checkpoint(self.path, weights_only=False)
        self.last_model_path = str(self.path)
        self._saved_step = trainer.global_step


def last_checkpoint_path(trainer: L.Trainer) -> Path:
    """Where this trainer's ``last.ckpt`` goes: its :class:`LastCheckpoint`'s, else the first ModelCheckpoint's
    folder, else ``<default_root_dir>/checkpoints`` (a Trainer built without the entry point)."""
    owners = [cb for cb in trainer.callbacks if isinstance(cb, LastCheckpoint)]
    if owners:
        return owners[0].path
    dirs = [cb.dirpath for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint) and cb.dirpath]
    return (Path(dirs[0]) if dirs else Path(trainer.default_root_dir) / CHECKPOINT_DIR) / LAST_NAME


def best_checkpoint(trainer: L.Trainer) -> str:
    """The best checkpoint a user's ModelCheckpoint kept (empty when there is none)."""
    kept = [cb.best_model_path for cb in trainer.checkpoint_callbacks
            if isinstance(cb, ModelCheckpoint) and not isinstance(cb, LastCheckpoint) and cb.best_model_path]
    return kept[0] if kept else ""
