"""``optimized_metric`` must be one the module logs: said in one line as soon as the loop that logs it has run.

The best checkpoint, early stopping and sweeps all follow ``optimized_metric`` (``val/acc`` by default). A
module of a user's that logs other names would otherwise train to the end and fail there, or stop with
Lightning's traceback from ``EarlyStopping`` after the first epoch. The check runs after the first validation
(a ``val/`` metric; already after the sanity check's when that logged no metric at all), or after the first
training epoch (a ``train/`` metric, or a module that does not validate). ``optimized_metric=null`` needs no metric: the checkpoint then keeps the
last epoch, and early stopping is left out (:func:`drop_callbacks_without_a_metric`).
"""

from __future__ import annotations

from lightning import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import EarlyStopping
from lightning.pytorch.utilities.model_helpers import is_overridden

from src.engine.utils.errors import ConfigError
from src.engine.utils.pylogger import RankedLogger

log = RankedLogger(__name__)


class MonitoredMetricCheck(Callback):
    """Refuse, once, a run whose module does not log ``metric``; list it first so it runs before EarlyStopping."""

    def __init__(self, metric: str) -> None:
        self.metric = metric
        self.checked = False

    @property
    def from_training(self) -> bool:
        return self.metric.startswith("train/")

    def on_sanity_check_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # A module may log a metric outside the sanity check only (a best-so-far tracker): that one waits for the
        # first validation; a module that logged nothing at all is told now
        if not self.from_training and not trainer.callback_metrics:
            self.check(trainer, pl_module, "the sanity check's validation")

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking and not self.from_training:
            self.check(trainer, pl_module, "the first validation")

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.from_training or not is_overridden("validation_step", pl_module):  # no validation to wait for
            self.check(trainer, pl_module, "the first training epoch")

    def check(self, trainer: Trainer, pl_module: LightningModule, where: str) -> None:
        if self.checked:
            return
        self.checked = True
        logged = sorted(trainer.callback_metrics)
        if self.metric in logged:
            return
        logs = f"it logged {', '.join(logged)}" if logged else "it logged no metric"
        choose = "optimized_metric=<one of those> (and optimized_mode=min or max)" if logged else \
            f"log {self.metric} with self.log"
        raise ConfigError(
            f"optimized_metric={self.metric} is not logged by {type(pl_module).__name__}: after {where} {logs}; "
            f"fix: {choose}, or optimized_metric=null (the checkpoint then keeps the last epoch, and early "
            "stopping steps aside)"
        )


def drop_callbacks_without_a_metric(callbacks: list[Callback], metric: str | None) -> list[Callback]:
    """With ``optimized_metric=null``, leave out the early stopping that would follow no metric, saying so; with a
    metric, put :class:`MonitoredMetricCheck` first."""
    if metric:
        return [MonitoredMetricCheck(metric), *callbacks]
    for cb in callbacks:
        if isinstance(cb, EarlyStopping) and cb.monitor in (None, "None", ""):
            log.info("optimized_metric=null: EarlyStopping is left out (it has no metric to follow)")
    return [cb for cb in callbacks if not (isinstance(cb, EarlyStopping) and cb.monitor in (None, "None", ""))]
