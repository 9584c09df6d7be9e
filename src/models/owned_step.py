"""The module owns its training step: forward, loss, metric updates, backward and the optimizer step.

Lightning's automatic optimization wraps each step in a closure and runs its hook fan-outs around it.
With manual optimization (Lightning's public API) the module runs the same operations, in the same order
(zero_grad, backward, the optimizer step through Lightning's precision plugin, then the step-interval
schedulers), so the numbers are the same bit for bit, with less work per step. Epoch-interval schedulers
step where Lightning steps them: after the epoch's last batch. A ReduceLROnPlateau scheduler steps on the
epoch's validation metric in ``on_train_epoch_end``, in both modes: before the epoch's ``last.ckpt``, so a
resume from it continues with the stepped scheduler (Lightning's loop steps it after that save, and does
not step it again on resume).

It runs where the strategy says its step is the module's (``runs_owned_step``: single device and DDP)
and the Trainer asks nothing of automatic optimization (gradient clipping, accumulation). Elsewhere the
step is Lightning's, said once in an info line. ``owned_step``: ``auto`` and ``true`` own it where it can
run (``true`` is kept for configs that name it); ``false`` never.

On one CUDA device the owned step is captured as a CUDA graph and replayed (``step_capture``,
:mod:`src.models.step_capture`): ``auto`` (the default) captures where the run is eligible and says in
one info line why not elsewhere; ``true`` refuses an ineligible run; ``false`` never captures.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import Strategy
from torch import Tensor
from torch.optim.lr_scheduler import ReduceLROnPlateau

from src.models.step_capture import (
    GRAPHS,
    StepCapture,
    capture_blocker,
    in_step_hook_listener,
    learning_rates_as_floats,
    overrides,
)
from src.utils import lightning_compat as compat
from src.utils.errors import ConfigError
from src.utils.hooks import RunsOwnedStep
from src.utils.pylogger import RankedLogger

log = RankedLogger(__name__)


def owned_step_blocker(trainer: L.Trainer, mode: str | bool) -> str | None:
    """Why this trainer's steps stay Lightning's under ``owned_step=mode`` (None: the module owns them)."""
    if mode is False:
        return "model.owned_step=false"
    strategy = trainer.strategy
    if not (isinstance(strategy, RunsOwnedStep) and strategy.runs_owned_step):
        return f"{type(strategy).__name__} runs its own step"
    if trainer.gradient_clip_val:
        return "gradient clipping is set on the Trainer (gradient_clip_val)"
    if trainer.accumulate_grad_batches != 1:
        return f"gradients accumulate over {trainer.accumulate_grad_batches} batches"
    return None


# Where the direct call is the default: a device type joins once tests/test_gpu.py's check of it has passed there
DIRECT_STEP_DEVICES = ("cpu", "cuda")


def direct_step_blocker(trainer: L.Trainer, module: L.LightningModule) -> str | None:
    """Why the eager owned step goes through ``manual_backward`` and Lightning's ``optimizer.step()`` (None: it
    calls backward and the optimizer itself).

    Those two calls add three hook fan-outs to every step (``on_before_backward``, ``on_after_backward``,
    ``on_before_optimizer_step``, on the module and each callback) and a closure. Where nothing listens to
    those hooks, the precision plugin only forwards (32-true, or bf16-mixed: no loss scaler) and the strategy
    adds nothing to the optimizer step, the direct call runs the same operations in the same order.
    """
    device = trainer.strategy.root_device.type
    if device not in DIRECT_STEP_DEVICES:
        return f"the direct call has not run on {device} yet (tests/test_gpu.py checks it)"
    listener = in_step_hook_listener(trainer, module)
    if listener is not None:
        return f"{listener} runs inside the step"
    if overrides(module, L.LightningModule, "manual_backward"):
        return f"{type(module).__name__} overrides manual_backward"
    precision = trainer.precision_plugin
    if type(precision) not in (Precision, MixedPrecision) or getattr(precision, "scaler", None) is not None:
        return f"the precision plugin {type(precision).__name__} takes part in backward and the optimizer step"
    if type(trainer.strategy).backward is not Strategy.backward or compat.strategy_adds_to_optimizer_step(
            trainer.strategy):
        return f"{type(trainer.strategy).__name__} takes part in backward or the optimizer step"
    if len(trainer.optimizers) != 1:
        return f"the module has {len(trainer.optimizers)} optimizers"
    return None


class OwnedStep:
    """Mixin for :class:`src.models.step_module.StepModule` (a LightningModule with ``model_step``/``record_step``)."""

    scheduler_monitor: str  # the metric a ReduceLROnPlateau scheduler follows
    _owned_for: tuple[Any, bool] | None = None  # (trainer, owns): decided once per trainer
    _epoch_ran_to_end = False  # the last owned step was its epoch's last batch
    _capture: StepCapture | None = None  # this fit's captured step (None: eager)
    _direct = False  # this fit's eager step calls backward and the optimizer itself (direct_step_blocker)
    step_capture_counts = (0, 0)  # (captures, replayed steps) of the last fit

    @property
    def automatic_optimization(self) -> bool:
        try:
            trainer = self.trainer
        except RuntimeError:  # not attached to a Trainer (yet): nothing to decide
            return True
        if self._owned_for is None or self._owned_for[0] is not trainer:
            blocker = owned_step_blocker(trainer, self.hparams.get("owned_step", "auto"))
            if blocker is not None and blocker != "model.owned_step=false":
                log.info(f"Lightning's automatic optimization runs the training step: {blocker}")
            self._owned_for = (trainer, blocker is None)
        return not self._owned_for[1]

    def on_fit_start(self) -> None:
        """Refuse an explicit capture request this run cannot honour now, before the sanity check and any compile
        (the optimizers and callbacks exist already); :meth:`on_train_start` decides the rest."""
        if self.hparams.get("step_capture", "auto") is True:
            blocker = capture_blocker(self.trainer, self, True)
            if blocker is not None:
                raise ConfigError(f"model.step_capture=true cannot capture this run: {blocker}; fix: set "
                                  "model.step_capture=auto (capture where it can) or false")

    def on_train_start(self) -> None:
        """Decide, once per fit, whether the owned step is captured (the optimizers, callbacks and any resumed state
        are in place now)."""
        self._capture = None
        if not self.automatic_optimization:
            blocker = direct_step_blocker(self.trainer, self)
            self._direct = blocker is None
            if blocker is not None:
                log.debug(f"the owned step runs through Lightning's manual_backward and optimizer.step: {blocker}")
        mode = self.hparams.get("step_capture", "auto")
        blocker = capture_blocker(self.trainer, self, mode)
        if blocker is None:
            step_lr = any(c.interval == "step" for c in self.trainer.lr_scheduler_configs)
            self._capture = StepCapture(self, GRAPHS[self.device.type], lr_on_device=step_lr)
            log.info("the training step is captured as a graph after its warm-up steps and replayed")
        elif mode == "auto" and not self.automatic_optimization:
            log.info(f"the owned training step runs eagerly: {blocker}")

    def on_train_end(self) -> None:
        capture, self._capture = self._capture, None  # frees the graph and its memory pool
        if capture is not None:
            self.step_capture_counts = (capture.captures, capture.replayed)
            log.info(f"{capture.replayed} of {self.trainer.global_step} training steps ran as replays of "
                     f"{capture.captures} captured graph(s)")

    def owned_training_step(self, batch: Any, batch_idx: int) -> Tensor:
        """One optimizer step, in the order Lightning's closure runs it, then the schedulers Lightning would step."""
        capture = self._capture
        if capture is None:
            loss = self._eager_step(batch)
        elif capture.can_replay(batch):
            loss = self.record_step("train", capture.step(batch))
        else:
            with capture.eager_step():
                loss = self._eager_step(batch)
        self._epoch_ran_to_end = batch_idx + 1 == self.trainer.num_training_batches
        self._step_schedulers(batch_idx)
        return loss.detach()

    def _eager_step(self, batch: Any) -> Tensor:
        optimizer = self.optimizers()
        loss = self.record_step("train", self.model_step(batch))
        optimizer.zero_grad()
        if self._direct:  # manual_backward and optimizer.step() less their hook fan-outs (direct_step_blocker)
            strategy = self.trainer.strategy
            strategy.pre_backward(loss)  # DDP readies its reducer here
            self.backward(loss)
            strategy.post_backward(loss)
            with compat.counted_manual_step(optimizer):
                optimizer.optimizer.step()
        else:
            self.manual_backward(loss)
            optimizer.step()
        return loss

    def _step_schedulers(self, batch_idx: int) -> None:
        """Step-interval schedulers after every step, epoch-interval ones after the epoch's last step (before its
        validation), as Lightning's loop does; ReduceLROnPlateau waits for the validation (``on_train_epoch_end``)."""
        for config in self.trainer.lr_scheduler_configs:
            if isinstance(config.scheduler, ReduceLROnPlateau):
                if config.interval == "step":
                    raise ConfigError("a ReduceLROnPlateau scheduler with interval 'step' needs Lightning's loop; "
                                      "fix: set model.owned_step=false")
                continue
            if config.interval == "step":
                index = batch_idx + 1
            elif self._epoch_ran_to_end:
                index = self.trainer.current_epoch + 1
            else:
                continue
            if index % config.frequency == 0:
                self.lr_scheduler_step(config.scheduler, None)

    def on_train_epoch_end(self) -> None:
        """ReduceLROnPlateau steps on the epoch's validation metric here, in either optimization mode: before the
        epoch's checkpoint, once per epoch that ran all its batches. Its own step count says whether this epoch's
        step is made already (a resume from the epoch's end), not Lightning's restart flag, which stays up for
        the whole of an epoch resumed mid-way."""
        trainer = self.trainer
        if not compat.epoch_ran_to_end(trainer):
            return
        for config in trainer.lr_scheduler_configs:
            if not (isinstance(config.scheduler, ReduceLROnPlateau) and config.interval == "epoch"):
                continue
            due = (trainer.current_epoch + 1) // config.frequency  # the steps made by the end of this epoch
            if (trainer.current_epoch + 1) % config.frequency or config.scheduler.last_epoch >= due:
                continue
            monitor = config.monitor or self.scheduler_monitor
            value = trainer.callback_metrics.get(monitor)
            if value is None:
                raise ConfigError(f"ReduceLROnPlateau follows {monitor}, which was not logged; fix: "
                                  f"set scheduler_monitor to one of {sorted(trainer.callback_metrics)}")
            super().lr_scheduler_step(config.scheduler, value)  # Lightning's step, past the skip below

    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        """Lightning's, less the epoch plateau step its loop takes after the epoch's checkpoint: taken before it,
        above."""
        if isinstance(scheduler, ReduceLROnPlateau) and any(
                c.scheduler is scheduler and c.interval == "epoch" for c in self.trainer.lr_scheduler_configs):
            return
        super().lr_scheduler_step(scheduler, metric)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        learning_rates_as_floats(checkpoint)  # a captured step may hold them as device tensors

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """A checkpoint of either mode resumes in either: its step count moves to this run's counter."""
        compat.carry_optimizer_steps(checkpoint, to_manual=not self.automatic_optimization)
