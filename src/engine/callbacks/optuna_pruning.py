"""In a trial of an Optuna search: report the validation metric after every epoch, stop when pruned.

Written here rather than taken from ``optuna_integration.PyTorchLightningPruningCallback``: that one needs
an ``optuna.Trial`` in every rank and an RDB storage under DDP, writes to the study from every rank, and
ends a pruned single-process run by raising ``TrialPruned`` out of ``fit``. Here only global rank 0 talks to
the study (child ranks replay the job and never see it), and a pruned run stops as an early-stopped one
does, on every rank at the same epoch, so its processes exit 0 and its run dir says ``status: pruned``.
"""

from __future__ import annotations

import lightning as L
import optuna
from lightning.pytorch.callbacks import Callback

from src.engine.run.status import PRUNED
from src.engine.search.study import trial_of_this_job


class OptunaPruning(Callback):
    """Report ``monitor`` to this job's trial at each epoch's validation (``trial.report``, step = epoch);
    when ``trial.should_prune()``, tell the study the trial is pruned and stop training on every rank.

    Outside a search's job (a plain run, a grid sweep) it reports nothing and never stops the run.
    """

    def __init__(self, monitor: str) -> None:
        self.monitor = monitor
        self._trial: optuna.trial.Trial | None = None
        self.ended_run_as: tuple[str, str] | None = None  # read by src/engine/run/status.py for status.yaml

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._trial = trial_of_this_job() if trainer.is_global_zero else None

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        epoch, value = trainer.current_epoch, trainer.callback_metrics.get(self.monitor)
        prune = False
        if self._trial is not None and value is not None:
            # a trial resumed from its checkpoint may report an epoch again: Optuna keeps the first value
            self._trial.report(float(value), step=epoch)
            prune = self._trial.should_prune()
        if not trainer.strategy.broadcast(prune):  # rank 0 decides for all
            return
        trainer.should_stop = True
        reported = "" if value is None else f": {self.monitor}={float(value):.6g}"
        self.ended_run_as = (PRUNED, f"pruned at epoch {epoch}{reported}")
        if self._trial is not None:
            self._trial.study.tell(self._trial, state=optuna.trial.TrialState.PRUNED)
