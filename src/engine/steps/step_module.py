"""Base LightningModule with a step protocol that parallel strategies can split apart.

A training step is two halves:

* ``model_step(batch) -> StepOutput``: pure computation (forward and loss), no logging;
* ``record_step(stage, out) -> loss``: metric updates and ``self.log``, once per *global* batch.

Single-process and DDP training call both in order (``training_step``). The ``dp``
strategy runs ``model_step`` on shards in parallel and ``record_step`` once on the
gathered outputs; the ``pipeline`` strategy computes the outputs across stages and then
calls ``record_step``. Keeping logging out of the parallel half is what makes the metric
updates race-free and exact.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning import Callback, LightningModule, Trainer
from torch import Tensor, nn
from torchmetrics import Metric

from src.engine.steps import owned_step
from src.engine.steps.optimizers import build_optimizer
from src.engine.steps.owned_step import OwnedStep
from src.engine.steps.step_output import StepOutput
from src.engine.utils import lightning_compat as compat
from src.engine.utils.seeding import rank_seed

__all__ = ["STAGES", "StepMachinery", "StepModule", "StepOutput"]

STAGES = ("train", "val", "test")


def prepare(module: StepModule, device_type: str) -> None:
    """What every stage's setup does to the module (each step idempotent: the callback and the module's own
    ``setup`` both call it, so a subclass's ``setup`` may skip ``super()``)."""
    compat.skip_nvml_check_without_nvml()  # the optimizer's per-step CUDA check, cheap where NVML is missing
    hparams = module.hparams
    if hparams.get("float32_matmul_precision"):
        torch.set_float32_matmul_precision(hparams.float32_matmul_precision)
    if hparams.get("channels_last") and device_type == "cuda" and not module.inputs_channels_last:
        module.net.to(memory_format=torch.channels_last)  # no-op on layers without 4-D weights
        module.inputs_channels_last = True
    if hparams.get("compile"):
        module.compile_net()


class StepMachinery(Callback):
    """The fit-time work of a :class:`StepModule`, in a callback the module contributes (``configure_callbacks``).

    Module hooks are the subclass's to override, often without ``super()`` (a template's empty
    ``on_train_epoch_end``): had this work lived there, such an override would have dropped it silently (a
    ReduceLROnPlateau that never steps). Lightning calls a callback's hooks just before the module's own, so
    each runs where the module's ran. A subclass that overrides ``configure_callbacks`` without ``super()`` is
    refused in one line (:meth:`OwnedStep._settle_step_owner`).
    """

    def setup(self, trainer: Trainer, pl_module: StepModule, stage: str) -> None:
        prepare(pl_module, trainer.strategy.root_device.type)

    def on_fit_start(self, trainer: Trainer, pl_module: StepModule) -> None:
        """Refuse what this run cannot honour (before the sanity check and any compile); then, from here on, this
        rank draws dropout masks (and the model's other random ops) from its own stream.

        Every rank is seeded alike, so the weights start equal, and Lightning's DDP strategy re-applies
        that seed at setup: left so, every rank would draw the same masks on different data. The
        stream derives from that seed and the global rank (:func:`src.engine.utils.seeding.rank_seed`). Only
        the CPU and this rank's current GPU are reseeded: the dp strategy has already given each of
        its other GPUs a stream of its own.
        """
        owned_step.refuse_capture_request(trainer, pl_module)
        if any(getattr(cb, "restores_random_state", False) for cb in trainer.callbacks):
            return  # a resume puts back the streams this fit stopped with (ResumeRandomState)
        seed = rank_seed(torch.initial_seed(), pl_module.global_rank, "model")
        torch.default_generator.manual_seed(seed)
        torch.cuda.manual_seed(seed)  # the current device only (lazily, if CUDA is not initialised yet)

    def on_train_start(self, trainer: Trainer, pl_module: StepModule) -> None:
        owned_step.start_owned_fit(trainer, pl_module)  # whether the step is captured
        if pl_module.best_of and trainer.ckpt_path is None:  # a resume restored it (ResumeMetricState)
            getattr(pl_module, f"val_{pl_module.best_of}_best").reset()

    def on_train_epoch_end(self, trainer: Trainer, pl_module: StepModule) -> None:
        owned_step.step_plateau_schedulers(trainer, pl_module)  # before the epoch's checkpoint

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: StepModule) -> None:
        """``val/<best_of>_best``: the best-so-far tracker, updated with this validation's value."""
        if not pl_module.best_of or trainer.sanity_checking:
            return
        best = getattr(pl_module, f"val_{pl_module.best_of}_best")
        best(getattr(pl_module, f"val_{pl_module.best_of}").compute())
        # Identical on every rank (the tracked metric is already synced), so the mean is exact.
        pl_module.log(f"val/{pl_module.best_of}_best", best.compute(), sync_dist=True, prog_bar=True)

    def on_train_end(self, trainer: Trainer, pl_module: StepModule) -> None:
        owned_step.end_owned_fit(trainer, pl_module)

    def on_save_checkpoint(self, trainer: Trainer, pl_module: StepModule, checkpoint: dict[str, Any]) -> None:
        owned_step.save_checkpoint(checkpoint)

    def on_load_checkpoint(self, trainer: Trainer, pl_module: StepModule, checkpoint: dict[str, Any]) -> None:
        owned_step.load_checkpoint(trainer, pl_module, checkpoint)


class StepModule(OwnedStep, compat.FastHookName, LightningModule):
    """Holds ``net``, builds the optimizer/scheduler from partial configs, and wires the steps.

    A subclass that sets ``best_of = "<name>"`` and a ``val_<name>_best`` tracker (``MaxMetric`` or
    ``MinMetric``) gets ``val/<name>_best`` logged after every validation epoch.

    Subclassing (docs/subclassing.md): override any Lightning hook, with or without ``super()``: the module
    overrides none that its machinery needs (that runs in :class:`StepMachinery`), but ``configure_callbacks``
    must keep ``super()``'s. ``self.automatic_optimization = False`` hands the step to your own
    ``training_step``; overriding ``training_step`` alone keeps Lightning's automatic optimization.

    Args:
        net: the network, an ``nn.Sequential`` of named blocks (the pipeline's split points).
        optimizer: a partial of the optimizer class (``_partial_: true``); ``scheduler`` likewise, or None.
        compile: ``nn.Module.compile`` the net in place (checkpoint keys unchanged), with ``compile_backend``
            and ``compile_mode`` (``None``, ``reduce-overhead``: CUDA graphs, ``max-autotune``).
        fused_optimizer: Adam/AdamW/SGD step in one kernel where the device has it (:mod:`.optimizers`).
        channels_last: on a GPU, convolution weights and 4-D inputs in NHWC, the layout cuDNN's tensor-core
            kernels take without a transpose.
        float32_matmul_precision: ``torch.set_float32_matmul_precision`` for this process (``high``: TF32 on
            GPUs that have it, for 32-true runs); ``None`` leaves torch's setting.
        owned_step: the module runs its own training step where the strategy allows it (single device, DDP):
            the same numbers as Lightning's automatic optimization (:mod:`src.engine.steps.owned_step`). ``"auto"``
            or ``True``: wherever it can run; ``False``: Lightning's step.
        step_capture: on one CUDA device, capture the owned step as a CUDA graph and replay it
            (:mod:`src.engine.steps.step_capture`). ``"auto"``: where the run is eligible; ``True``: refuse a run
            that is not; ``False``: never.
    """

    best_of: str | None = None
    scheduler_monitor = "val/loss"  # what a ReduceLROnPlateau scheduler follows
    machinery = StepMachinery
    capture_safe = True  # forward and model_step may run inside a captured step (src/engine/steps/step_capture.py)

    def __init__(
        self,
        net: nn.Module,
        optimizer: Any,
        scheduler: Any | None = None,
        compile: bool = False,
        compile_backend: str = "inductor",
        compile_mode: str | None = None,
        fused_optimizer: bool = True,
        channels_last: bool = False,
        float32_matmul_precision: str | None = None,
        owned_step: bool | str = "auto",
        step_capture: bool | str = "auto",
    ) -> None:
        super().__init__()
        # Only plain values go into the checkpoint's hparams, so it loads with torch.load(weights_only=True):
        # `net` is in the state dict already, and the optimizer/scheduler partials are code, not data.
        self.save_hyperparameters(logger=False, ignore=["net", "optimizer", "scheduler"])
        self.net = net
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.net_compiled = False
        self.inputs_channels_last = False  # set in setup, on a GPU, with channels_last

    def forward(self, x: Tensor) -> Tensor:
        if self.inputs_channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return self.net(x)

    def criterion(self, output: Tensor, target: Tensor) -> Tensor:
        raise NotImplementedError

    def model_step(self, batch: tuple[Tensor, Tensor]) -> StepOutput:
        x, target = batch
        output = self(x)
        return StepOutput(loss=self.criterion(output, target), output=output, target=target)

    def record_step(self, stage: str, out: StepOutput) -> Tensor:
        raise NotImplementedError

    def log_epoch_metric(self, name: str, metric: Metric, prog_bar: bool = True) -> None:
        """``self.log(name, metric, on_step=False, on_epoch=True)``, called only on the metric's first update since its last reset.

        Lightning keeps a reference to a logged ``Metric``, calls ``compute()`` (synced across
        ranks) when the epoch's value is read and ``reset()`` at the epoch's end, so logging
        it once per epoch yields the same values as logging it every step. Each ``self.log``
        call re-registers the metric (Lightning walks its state), a cost on every training step.
        Call this *after* ``metric.update``.
        """
        if metric.update_count == 1:
            self.log(name, metric, on_step=False, on_epoch=True, prog_bar=prog_bar)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.record_step("val", self.model_step(batch))

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.record_step("test", self.model_step(batch))

    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self.prediction(self(batch[0]))

    def prediction(self, output: Tensor) -> Tensor:
        """What ``src/predict.py`` writes for one batch of network output (here the output itself)."""
        return output

    def resumable_metrics(self, mid_epoch: bool) -> dict[str, Metric]:
        """The metrics whose running state a checkpoint keeps: the best-so-far tracker, and (``mid_epoch``) the
        training epoch's (:class:`src.engine.checkpointing.resume_state.ResumeMetricState`). Validation and test metrics
        start afresh."""
        names = [n for n, m in self.named_children() if isinstance(m, Metric) and n.startswith("train_")] * mid_epoch
        if self.best_of:
            names.append(f"val_{self.best_of}_best")
        return {n: getattr(self, n) for n in names}

    def setup(self, stage: str) -> None:
        """:func:`prepare` (done already by :class:`StepMachinery` in a fit; kept for callers without a Trainer)."""
        prepare(self, self.trainer.strategy.root_device.type if self._trainer is not None else "cpu")

    def configure_callbacks(self) -> list[Callback]:
        """:class:`StepMachinery`, which runs this module's fit-time work; a subclass adds its own after it:
        ``return [*super().configure_callbacks(), MyCallback()]``."""
        return [StepMachinery()]

    def compile_net(self) -> None:
        """Compile ``net`` in place with ``nn.Module.compile``, once per module, for every stage.

        ``self.net = torch.compile(self.net)`` would wrap the net, prefixing its state-dict keys with
        ``_orig_mod.``: a compiled run's checkpoint would then fit no fresh model (resume and eval would
        reject it), and a second ``fit`` would wrap the wrapper. Compiling in place keeps the net's own
        keys, so a checkpoint is the same with compile on or off.
        """
        if not self.net_compiled:
            self.net.compile(backend=self.hparams.compile_backend, mode=self.hparams.compile_mode)
            self.net_compiled = True

    def configure_optimizers(self) -> dict[str, Any]:
        params = [p for p in self.parameters() if p.requires_grad]
        optimizer = build_optimizer(self.optimizer_factory, params, fused=self.hparams.fused_optimizer)
        if self.scheduler_factory is None:
            return {"optimizer": optimizer}
        scheduler = self.scheduler_factory(optimizer=optimizer)
        config = {"scheduler": scheduler, "interval": "epoch", "frequency": 1}
        if self.automatic_optimization:  # also for the owned step (Lightning keeps it); not under a user's manual step
            config["monitor"] = self.scheduler_monitor
        return {"optimizer": optimizer, "lr_scheduler": config}
