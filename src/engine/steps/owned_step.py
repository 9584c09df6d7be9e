"""The module owns its training step: forward, loss, metric updates, backward and the optimizer step.

Lightning's automatic optimization wraps each step in a closure and runs its hook fan-outs around it.
With manual optimization (Lightning's public API) the module runs the same operations, in the same order
(zero_grad, backward, the optimizer step through Lightning's precision plugin, then the step-interval
schedulers), so the numbers are the same bit for bit, with less work per step. Epoch-interval schedulers
step where Lightning steps them: after the epoch's last batch. A ReduceLROnPlateau scheduler steps on the
epoch's validation metric at the training epoch's end (:func:`step_plateau_schedulers`), in both modes: before the epoch's ``last.ckpt``, so a
resume from it continues with the stepped scheduler (Lightning's loop steps it after that save, and does
not step it again on resume).

It runs where the strategy says its step is the module's (``runs_owned_step``: single device and DDP)
and the Trainer asks nothing of automatic optimization (gradient clipping, accumulation). Elsewhere the
step is Lightning's, said once in an info line. ``owned_step``: ``auto`` and ``true`` own it where it can
run (``true`` is kept for configs that name it); ``false`` never.

On one CUDA device the owned step is captured as a CUDA graph and replayed (``step_capture``,
:mod:`src.engine.steps.step_capture`): ``auto`` (the default) captures where the run is eligible and says in
one info line why not elsewhere; ``true`` refuses an ineligible run; ``false`` never captures.

Subclasses (docs/subclassing.md): a module that sets ``self.automatic_optimization`` (Lightning's switch) gets
that choice, and the project's step steps aside; one that overrides ``training_step`` keeps Lightning's step.
The fit-time work lives in :class:`src.engine.steps.step_module.StepMachinery`, a callback the module contributes
through ``configure_callbacks``, not in module hooks a subclass may override without ``super()``: the
functions below are what it calls.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.optim.lr_scheduler import ReduceLROnPlateau

from src.engine.steps.step_capture import (
    GRAPHS,
    StepCapture,
    capture_blocker,
    in_step_hook_listener,
    learning_rates_as_floats,
    overrides,
)
from src.engine.utils import lightning_compat as compat
from src.engine.utils.errors import ConfigError
from src.engine.utils.hooks import RunsOwnedStep
from src.engine.utils.pylogger import RankedLogger

log = RankedLogger(__name__)


def owned_step_blocker(trainer: L.Trainer, mode: str | bool, module: Any = None) -> str | None:
    """Why this trainer's steps stay Lightning's under ``owned_step=mode`` (None: the module owns them)."""
    if mode is False:
        return "model.owned_step=false"
    if module is not None and type(module).training_step is not OwnedStep.owned_step_dispatch:
        return f"{type(module).__name__} overrides training_step"
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
    if type(trainer.strategy).backward is not Strategy.backward or adds_to_optimizer_step(trainer.strategy):
        return f"{type(trainer.strategy).__name__} takes part in backward or the optimizer step"
    if len(trainer.optimizers) != 1:
        return f"the module has {len(trainer.optimizers)} optimizers"
    return None


def adds_to_optimizer_step(strategy: Strategy) -> bool:
    """Whether ``strategy.optimizer_step`` does more than its precision plugin's step: an override of it, or
    DDP's post-local-SGD model averaging, which the project's DDPStrategy reports (``averages_models``)."""
    step = type(strategy).optimizer_step
    if step is LightningDDPStrategy.optimizer_step:  # averages after the step when model_averaging_period is set
        return getattr(strategy, "averages_models", True)  # a DDP that does not say: assume it averages
    return step is not Strategy.optimizer_step


class OwnedStep:
    """Mixin for :class:`src.engine.steps.step_module.StepModule` (a LightningModule with ``model_step``/``record_step``)."""

    scheduler_monitor: str  # the metric a ReduceLROnPlateau scheduler follows
    machinery: type[L.Callback]  # the callback that runs the fit-time work (StepModule: StepMachinery)
    _optimization_choice: bool | None = None  # set by ``self.automatic_optimization = ...`` (the user's choice)
    _owned_for: tuple[Any, bool, bool] | None = None  # (trainer, owns, checked): decided once per trainer
    _epoch_ran_to_end = False  # the last owned step was its epoch's last batch
    _capture: StepCapture | None = None  # this fit's captured step (None: eager)
    _direct = False  # this fit's eager step calls backward and the optimizer itself (direct_step_blocker)
    step_capture_counts = (0, 0)  # (captures, replayed steps) of the last fit

    @property
    def automatic_optimization(self) -> bool:
        """Lightning's switch. Set (``self.automatic_optimization = False`` in ``__init__``, as Lightning documents),
        the choice is the user's. Unset, the module owns its step where :func:`owned_step_blocker` allows it; until
        the optimizers are configured it answers True, so that Lightning reads ``configure_optimizers``' schedulers
        as under automatic optimization (keeping ``monitor`` and ``strict``, which the owned step follows)."""
        trainer = self._trainer
        if trainer is None:  # not attached to a Trainer (yet): nothing to decide
            return True if self._optimization_choice is None else self._optimization_choice
        state = self._owned_for
        if state is None or state[0] is not trainer or not state[2]:
            state = self._settle_step_owner(trainer)
        if self._optimization_choice is not None:
            return self._optimization_choice
        return not (state[1] and state[2])

    @automatic_optimization.setter
    def automatic_optimization(self, value: bool) -> None:
        self._optimization_choice = bool(value)

    def _settle_step_owner(self, trainer: L.Trainer) -> tuple[Any, bool, bool]:
        state = self._owned_for
        if state is None or state[0] is not trainer:
            owns = False
            if self._optimization_choice is None:
                blocker = owned_step_blocker(trainer, self.hparams.get("owned_step", "auto"), self)
                if blocker is not None and blocker != "model.owned_step=false":
                    log.info(f"Lightning's automatic optimization runs the training step: {blocker}")
                owns = blocker is None
            state = (trainer, owns, False)
        if trainer.strategy.optimizers:  # configured: Lightning has attached the module's callbacks by now
            checked = (trainer, state[1], True)
            if not any(isinstance(cb, self.machinery) for cb in trainer.callbacks):
                self._owned_for = checked  # said once: the hooks Lightning runs on the way out read this property too
                raise ConfigError(
                    f"{type(self).__name__}.configure_callbacks leaves out {self.machinery.__name__}, which runs the "
                    "project's schedulers, seeding, compile and step capture for this module; fix: return "
                    "[*super().configure_callbacks(), <your callbacks>]")
            state = checked
        self._owned_for = state
        return state

    def step_is_manual(self, trainer: L.Trainer) -> bool:
        """Whether this fit's training step runs under manual optimization (the owned step's or the user's), also
        before the optimizers are configured (when the property still answers for their configuration)."""
        if self._optimization_choice is not None:
            return not self._optimization_choice
        state = self._owned_for
        if state is None or state[0] is not trainer:
            state = self._settle_step_owner(trainer)
        return state[1]

    def owned_step_dispatch(self, batch: Any, batch_idx: int) -> Tensor:
        """``training_step``: the owned step where the module owns it, else Lightning's (forward, loss, logging)."""
        if not self.automatic_optimization:
            return self.owned_training_step(batch, batch_idx)
        return self.record_step("train", self.model_step(batch))

    training_step = owned_step_dispatch

    def owned_training_step(self, batch: Any, batch_idx: int) -> Tensor:
        """One optimizer step, in the order Lightning's closure runs it, then the schedulers Lightning would step."""
        capture = self._capture
        if capture is None:
            loss = self._eager_step(batch)
        elif capture.can_replay(batch):
            out = capture.step(batch)
            if out is None:  # the capture failed (one warning said so): this step and the fit's others run eagerly
                self._capture = None
                self.step_capture_counts = (capture.captures, capture.replayed)
                loss = self._eager_step(batch)
            else:
                loss = self.record_step("train", out)
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
            with compat.counted_manual_step(self.trainer):
                optimizer.optimizer.step()
        else:
            self.manual_backward(loss)
            optimizer.step()
        return loss

    def _step_schedulers(self, batch_idx: int) -> None:
        """Step-interval schedulers after every step, epoch-interval ones after the epoch's last step (before its
        validation), as Lightning's loop does; ReduceLROnPlateau waits for the validation (:func:`step_plateau_schedulers`)."""
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

    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        """Lightning's, less a second plateau step in an epoch: :func:`step_plateau_schedulers` makes the epoch's
        before its checkpoint, and Lightning's loop (automatic optimization) asks for it again after that save."""
        if self._optimization_choice is not False and plateau_step_made(self.trainer, scheduler):
            return
        super().lr_scheduler_step(scheduler, metric)


def plateau_step_made(trainer: L.Trainer, scheduler: Any) -> bool:
    """Whether ``scheduler`` (an epoch-interval ReduceLROnPlateau of this fit) has made this epoch's step already: its
    own step count says so (not Lightning's restart flag, which stays up for the whole of an epoch resumed
    mid-way)."""
    if not isinstance(scheduler, ReduceLROnPlateau):
        return False
    for config in trainer.lr_scheduler_configs:
        if config.scheduler is scheduler and config.interval == "epoch":
            return scheduler.last_epoch >= (trainer.current_epoch + 1) // config.frequency
    return False


# -- what the module's callback (src.engine.steps.step_module.StepMachinery) runs ---------------------------------------


def refuse_capture_request(trainer: L.Trainer, module: Any) -> None:
    """At fit start (the optimizers and callbacks exist): refuse an explicit capture request this run cannot honour,
    and a manual-optimization switch with no manual step to run, each in one line."""
    if module._optimization_choice is False and type(module).training_step is OwnedStep.owned_step_dispatch:
        raise ConfigError(f"{type(module).__name__} sets automatic_optimization = False but keeps the project's "
                          "training_step; fix: write your own manual training_step (self.optimizers(), "
                          "self.manual_backward(loss), optimizer.step()), or leave automatic_optimization unset")
    if module.hparams.get("step_capture", "auto") is True:
        blocker = capture_blocker(trainer, module, True)
        if blocker is not None:
            raise ConfigError(f"model.step_capture=true cannot capture this run: {blocker}; fix: set "
                              "model.step_capture=auto (capture where it can) or false")


def start_owned_fit(trainer: L.Trainer, module: Any) -> None:
    """At train start (the optimizers, callbacks and any resumed state are in place): whether the eager owned step
    calls backward and the optimizer itself, and whether the step is captured."""
    module._capture = None
    module.step_capture_counts = (0, 0)
    if not module.automatic_optimization and module._optimization_choice is None:
        blocker = direct_step_blocker(trainer, module)
        module._direct = blocker is None
        if blocker is not None:
            log.debug(f"the owned step runs through Lightning's manual_backward and optimizer.step: {blocker}")
    mode = module.hparams.get("step_capture", "auto")
    blocker = capture_blocker(trainer, module, mode)
    if blocker is None:
        step_lr = any(c.interval == "step" for c in trainer.lr_scheduler_configs)
        module._capture = StepCapture(module, GRAPHS[module.device.type], lr_on_device=step_lr)
        log.info("the training step is captured as a graph after its warm-up steps and replayed")
    elif mode == "auto" and not module.automatic_optimization and module._optimization_choice is None:
        log.info(f"the owned training step runs eagerly: {blocker}")


def end_owned_fit(trainer: L.Trainer, module: Any) -> None:
    capture, module._capture = module._capture, None  # frees the graph and its memory pool
    if capture is not None:
        module.step_capture_counts = (capture.captures, capture.replayed)
        log.info(f"{capture.replayed} of {trainer.global_step} training steps ran as replays of "
                 f"{capture.captures} captured graph(s)")


def step_plateau_schedulers(trainer: L.Trainer, module: Any) -> None:
    """At the training epoch's end: each epoch-interval ReduceLROnPlateau steps on the epoch's validation metric,
    once per epoch that ran all its batches, before the epoch's checkpoint, through the module's
    ``lr_scheduler_step`` (as Lightning calls it), in either optimization mode. Under Lightning's optimization, a
    module whose own ``lr_scheduler_step`` may skip :meth:`OwnedStep.lr_scheduler_step`'s check leaves the step to
    Lightning's loop (after the checkpoint, as Lightning makes it): stepped once, never twice. A module that set
    ``automatic_optimization = False`` steps its schedulers itself, as Lightning documents."""
    if module._optimization_choice is False or not compat.epoch_ran_to_end(trainer):
        return
    for config in trainer.lr_scheduler_configs:
        if not (isinstance(config.scheduler, ReduceLROnPlateau) and config.interval == "epoch"):
            continue
        if (trainer.current_epoch + 1) % config.frequency or plateau_step_made(trainer, config.scheduler):
            continue
        if module.automatic_optimization and overrides(module, OwnedStep, "lr_scheduler_step"):
            if not getattr(module, "_said_plateau_after_save", False):
                module._said_plateau_after_save = True
                log.info(f"ReduceLROnPlateau steps after the epoch's checkpoint, in Lightning's loop: "
                         f"{type(module).__name__} overrides lr_scheduler_step")
            continue
        monitor = config.monitor or module.scheduler_monitor
        value = trainer.callback_metrics.get(monitor)
        if value is None:
            if config.strict:
                raise ConfigError(f"ReduceLROnPlateau follows {monitor}, which was not logged; fix: set the scheduler's "
                                  f"monitor (or scheduler_monitor) to one of {sorted(trainer.callback_metrics)}")
            rank_zero_warn(f"ReduceLROnPlateau conditioned on metric {monitor} which is not available; it does not "
                           "step this epoch (strict=False)")
            continue
        module.lr_scheduler_step(config.scheduler, value)


def save_checkpoint(checkpoint: dict[str, Any]) -> None:
    learning_rates_as_floats(checkpoint)  # a captured step may hold them as device tensors


def load_checkpoint(trainer: L.Trainer, module: Any, checkpoint: dict[str, Any]) -> None:
    """A checkpoint of either mode resumes in either: its step count moves to this run's counter."""
    compat.carry_optimizer_steps(checkpoint, to_manual=module.step_is_manual(trainer))
