"""``checkpoints/last.ckpt``: the checkpoint a killed, stopped or finished run resumes from.

Lightning 2.6's ModelCheckpoint writes ``last.ckpt`` at an epoch's end only when it also saved a top-k
file at that step: a run whose metric stopped improving, or that ended on ``max_steps`` between two
intervals, kept an older ``last.ckpt`` than its final state. :class:`LastCheckpoint` writes it every
``every_n_train_steps``, at the end of each training epoch (after its validation) and when ``fit``
ends, whatever the monitored metric did, and saves nothing else. A periodic save never falls between a step
and the validation due after it (a resume from there would skip that validation): it waits for the
validation's end, and on an epoch's last batch for the epoch's end. The epoch's training row reaches the
loggers before the epoch's save (:func:`src.engine.utils.lightning_compat.log_training_epoch_now`). A one-process
stop signal noted at such a batch waits the same way (:meth:`LastCheckpoint.stop_at_next_save_point`).

A training loader that cannot resume mid-epoch (a plain ``DataLoader``: no ``state_dict``/``load_state_dict``)
would replay the epoch's first batches after a mid-epoch resume and never reach its last ones. With such a
loader ``last.ckpt`` is written at epoch ends only (and when ``fit`` ends), and a stop signal keeps the last
one: a resume starts again from the start of the epoch it stopped in, with that epoch's shuffle, said in one
line at the fit's start. The project's loaders and torchdata's ``StatefulDataLoader`` resume mid-epoch.
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, Timer
from lightning.pytorch.trainer.states import TrainerFn

from src.engine.checkpointing.loader_position import position_blocker
from src.engine.run.layout import CHECKPOINT_DIR
from src.engine.utils import lightning_compat as compat
from src.engine.utils.pylogger import RankedLogger

log = RankedLogger(__name__)

LAST_NAME = f"{ModelCheckpoint.CHECKPOINT_NAME_LAST}{ModelCheckpoint.FILE_EXTENSION}"


class LastCheckpoint(ModelCheckpoint):
    """A ModelCheckpoint (so Lightning adds no default one) that owns ``<dirpath>/last.ckpt`` alone."""

    def __init__(self, dirpath: str | Path, every_n_train_steps: int = 1000) -> None:
        super().__init__(dirpath=dirpath, save_top_k=0, save_last=True, every_n_train_steps=every_n_train_steps,
                         enable_version_counter=False)
        self.every_n_steps = every_n_train_steps
        self._saved_step = -1
        self._after_validation = False  # a periodic save waits for the validation after its step
        self._stop: Callable[[], Any] | None = None  # a stop signal's stop, made at the next save point
        self._stop_waited = False  # ... which it has waited for since an earlier batch
        self._stopping_under: list | None = None  # saved while should_stop was set: the fit's limits then
        self._resumed_stopping_under: list | None = None
        self.mid_epoch = True  # this fit's training loader resumes mid-epoch (set at its start)
        # the stop of a signal that came after the fit's last check, or None (set by src.engine.runtime.sigterm's handlers)
        self.late_stop: Callable[[L.Trainer], Callable[[], Any] | None] | None = None

    @property
    def path(self) -> Path:
        return Path(self.dirpath) / LAST_NAME

    @property
    def state_key(self) -> str:
        # ModelCheckpoint's key holds the save interval: a relaunch with another interval would not get this
        # state back (and Lightning would build the key at every hook it calls)
        return type(self).__name__

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "stopping_under": self._stopping_under}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._resumed_stopping_under = state_dict.get("stopping_under")

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage != "fit":
            return
        # A checkpoint callback after this one sees a validation or an epoch's end after the save (or stop) made there
        checkpoints = trainer.checkpoint_callbacks
        later = [type(cb).__name__ for cb in checkpoints[checkpoints.index(self) + 1:]]
        if later:
            log.warning(f"{', '.join(later)} come(s) after LastCheckpoint: put your callbacks first, e.g. "
                        "callbacks=[*mine, *resume_callbacks(run_dir)]")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._saved_step = trainer.global_step  # a resumed fit holds that step already
        blocker = position_blocker(trainer)
        self.mid_epoch = blocker is None
        if blocker is not None:
            log.info(f"{blocker} cannot resume mid-epoch, so last.ckpt is written at epoch ends only: a resume "
                     "starts again from the start of the epoch it stopped in; fix (to resume mid-epoch): return a "
                     "torchdata StatefulDataLoader from train_dataloader")
        # Saved while early stopping, pruning or a limit was stopping the fit: Lightning does not keep should_stop,
        # so a resume from there (a stop signal's, or a kill's before the run was marked finished) trained on.
        if self._resumed_stopping_under is not None and self._resumed_stopping_under == _limits(trainer):
            trainer.should_stop = True
            log.info(f"last.ckpt was saved while the fit was stopping (early stopping, pruning or a limit), at epoch "
                     f"{trainer.current_epoch}, global step {trainer.global_step}: the resumed fit stops where it would "
                     "have (a larger trainer.max_epochs, max_steps or max_time trains on)")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # Here, after every other callback (Lightning runs checkpoint callbacks last): the max_steps stop and the
        # Timer have set should_stop, which makes a validation follow this batch.
        if self._stop is not None:
            if self._stop_waited or not (self._is_last_batch(trainer) or compat.validation_follows(trainer)):
                self._make_stop(trainer)  # nothing to wait for, or what it waited for did not run (an empty validation set)
            self._stop_waited = True
        # also a save that waited for a validation which did not run (an empty validation set): made one step late
        due = self._after_validation or (self.every_n_steps and trainer.global_step % self.every_n_steps == 0)
        due = due and self.mid_epoch
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

    def stop_at_next_save_point(self, stop: Callable[[], Any]) -> None:
        """Make a stop noted in ``on_train_batch_end`` (``stop`` saves ``last.ckpt`` and ends the run) at the end of
        this batch, or, where a validation or the epoch's end follows it, in place of the save after them."""
        if self._stop is None:
            self._stop, self._stop_waited = stop, False

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # The epoch's training row goes to the loggers before its checkpoint: a kill between the two would
        # leave a resume (from the epoch's end) that never logs it. Its synced metrics are computed on every
        # rank here, before the save's collectives: one order on every rank.
        compat.log_training_epoch_now(trainer)
        self._save_or_stop(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or self._is_last_batch(trainer):  # an epoch's last validation: its end saves
            return
        if not self.mid_epoch:  # a validation within the epoch: no save here, and a stop waits for nothing
            if self._stop is not None:
                self._make_stop(trainer)
            return
        if self._after_validation or self._stop is not None:  # the save, or the stop, that waited for it
            self._after_validation = False
            self._save_or_stop(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for logger in trainer.loggers:  # what the run logged is on disk before the checkpoint that ends it
            logger.save()
        self.save(trainer, final=True)  # also after an epoch-end save: the loops now count that epoch as done
        if self._stop is None and self.late_stop is not None:  # a signal after the last check: the job stops
            self._stop = self.late_stop(trainer)  # here, before any test
        if self._stop is not None:  # the fit ended where a stop waited: the stop keeps the final save
            self._make_stop(trainer)

    def _save_or_stop(self, trainer: L.Trainer) -> None:
        # Where should_stop ends the fit here (early stopping, pruning), the stop waits for the fit's final save.
        if self._stop is not None and not compat.fit_ends_on_should_stop(trainer):
            self._make_stop(trainer)
        self.save(trainer)

    def _make_stop(self, trainer: L.Trainer) -> None:
        stop, self._stop = self._stop, None
        self._note_stopping(trainer)
        stop()  # saves last.ckpt here and ends the run

    def _note_stopping(self, trainer: L.Trainer) -> None:
        """What the next checkpoint says of should_stop (see :meth:`on_train_start`)."""
        self._stopping_under = _limits(trainer) if trainer.should_stop else None

    def save(self, trainer: L.Trainer, final: bool = False) -> None:
        """Write ``last.ckpt`` on every rank's call (rank 0 writes): once per global step, and when fit ends."""
        if trainer.fast_dev_run or trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return
        if trainer.global_step == self._saved_step and not final:  # e.g. the epoch's end right after its step
            return
        self._note_stopping(trainer)
        trainer.save_checkpoint(self.path, weights_only=False)
        self.last_model_path = str(self.path)
        self._saved_step = trainer.global_step

    @staticmethod
    def _is_last_batch(trainer: L.Trainer) -> bool:
        return trainer.fit_loop.epoch_loop.batch_progress.is_last_batch


def saves_mid_epoch(trainer: L.Trainer) -> bool:
    """Whether a stop mid-epoch may save ``last.ckpt`` there: its training loader resumes mid-epoch."""
    return all(cb.mid_epoch for cb in trainer.callbacks if isinstance(cb, LastCheckpoint))


def _limits(trainer: L.Trainer) -> list:
    """The limits a fit ran under: a resume under others (a larger max_epochs) means to train on."""
    timers = [cb for cb in trainer.callbacks if isinstance(cb, Timer)]
    return [trainer.max_epochs, trainer.max_steps, *map(_max_time, timers)]


def _max_time(timer: Timer) -> float | None:
    """A Timer's ``max_time`` in seconds, to the millisecond: it shows the limit only as remaining + elapsed, two
    clock reads microseconds apart."""
    remaining = timer.time_remaining()
    return None if remaining is None else round(remaining + timer.time_elapsed(), 3)


def last_checkpoint_path(trainer: L.Trainer) -> Path:
    """Where this trainer's ``last.ckpt`` goes: its :class:`LastCheckpoint`'s, else the first ModelCheckpoint's
    folder, else ``<default_root_dir>/checkpoints`` (a Trainer built without the entry point)."""
    owners = [cb for cb in trainer.callbacks if isinstance(cb, LastCheckpoint)]
    if owners:
        return owners[0].path
    dirs = [cb.dirpath for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint) and cb.dirpath]
    return (Path(dirs[0]) if dirs else Path(trainer.default_root_dir) / CHECKPOINT_DIR) / LAST_NAME


def run_position(trainer: L.Trainer) -> str:
    """"epoch E, global step S" of the training this process's ranks ran.

    A ddp_spawn parent's own trainer runs no loop (Lightning brings back its weights and metrics, not its
    progress). After a fit it has the position its launcher brought back from rank 0. When the ranks ended
    otherwise it can only say where their ``last.ckpt`` is (read memory-mapped, without its tensors): exact
    after a stop signal, which saves it at the stop; the last save before a failure or a Ctrl-C.
    """
    launcher = trainer.strategy.launcher
    if not (isinstance(launcher, compat.MultiProcessingLauncher) and launcher.procs):  # not the spawning parent
        return trainer_position(trainer)
    brought_back = getattr(launcher, "ranks_position", None)
    if brought_back:
        return brought_back
    with contextlib.suppress(OSError, RuntimeError, KeyError, pickle.UnpicklingError):
        saved = torch.load(last_checkpoint_path(trainer), map_location="cpu", weights_only=True, mmap=True)
        return f"epoch {saved['epoch']}, global step {saved['global_step']} (the ranks' last save)"
    return "an unknown step (no last.ckpt yet)"


def trainer_position(trainer: L.Trainer) -> str:
    """"epoch E, global step S" of this process's own trainer."""
    return f"epoch {trainer.current_epoch}, global step {trainer.global_step}"


def best_checkpoint(trainer: L.Trainer) -> str:
    """The best checkpoint a user's ModelCheckpoint kept (empty when there is none)."""
    kept = [cb.best_model_path for cb in trainer.checkpoint_callbacks
            if isinstance(cb, ModelCheckpoint) and not isinstance(cb, LastCheckpoint) and cb.best_model_path]
    return kept[0] if kept else ""
