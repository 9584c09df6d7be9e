"""``dp``: single-process data parallelism (``torch.nn.DataParallel`` semantics) for Lightning 2.x.

Lightning 2.0 removed its DataParallel strategy; this one is built on the project's step
protocol (:mod:`src.engine.steps.step_module`) instead of wrapping the module:

1. the global batch (``data.batch_size`` samples, all of it: ``distributed_sampler_kwargs``
   report one replica) is split into one shard per device;
2. each device gets a replica (CUDA: ``torch.nn.parallel.replicate``; CPU: replicas sharing the
   root's parameter tensors) and runs ``model_step(shard)`` in its own thread;
3. the step outputs are gathered on the root device (``loss`` as the sample-weighted mean, so
   it equals the full-batch loss; ``output``/``target`` concatenated in order);
4. ``record_step(stage, gathered)`` runs ONCE on the main thread: logging and torchmetrics
   updates see the whole batch, race-free.

Backward of the gathered loss sums every shard's gradient into the root parameters, so one
dp step equals one single-device step on the full batch (up to float rounding; BatchNorm
normalizes each shard separately, as with ``nn.DataParallel``). On CPU, ``devices=N`` gives N
threads over the same parameters: real parallel execution of the same logic, so it is tested
without GPUs.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities import move_data_to_device
from lightning.pytorch.strategies import ParallelStrategy
from torch import Tensor

from src.engine.checkpointing.io import AtomicCheckpointIODefault
from src.engine.runtime.loader_workers import WorkersOutliveStopSignals
from src.engine.strategies.dp.shards import (
    ShardRunner,
    batch_size_of,
    gather_step_outputs,
    make_replicas,
    shard_sizes,
    split_batch,
)
from src.engine.strategies.global_batch import check_dp_batch
from src.engine.strategies.options import refuse_foreign_options
from src.engine.strategies.protocols import STEP_MEMBERS, missing_members, protocol_error
from src.engine.utils import lightning_compat as compat
from src.engine.utils.errors import ConfigError


def _refuse_bound_forwards(modules: list[str]) -> None:
    raise ConfigError(f"dp cannot replicate modules whose forward is bound to the instance ({', '.join(modules)}; e.g. "
                      "by torch.compile): a replica would run the original's parameters; fix: set model.compile=false")


class DataParallelStrategy(WorkersOutliveStopSignals, AtomicCheckpointIODefault, ParallelStrategy):
    """Split each batch across ``trainer.devices`` devices of one process; see the module docstring.

    The Trainer fills in ``parallel_devices`` from ``accelerator``/``devices`` (CPU ``devices=2``
    gives two CPU "devices", i.e. two threads on the same CPU). Checkpoints hold the root
    module's plain state dict, loadable by any single-device run; without a ``checkpoint_io``
    they are written by :class:`~src.engine.checkpointing.io.AtomicCheckpointIO`.
    """

    strategy_name = "dp"
    names_every_option = True  # its constructor passes none of its bases' options on (src/engine/strategies/options.py)

    def __init__(
        self,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        checkpoint_io: Any | None = None,
        precision_plugin: pl.plugins.Precision | None = None,
        **unknown: Any,
    ) -> None:
        refuse_foreign_options(type(self), unknown)
        self._num_nodes = 1
        self._runner: ShardRunner | None = None
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=None,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )

    # -- configuration checks (the accelerator connector sets these while the Trainer is built) ----
    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        if num_nodes != 1:
            raise ConfigError(
                f"trainer.num_nodes={num_nodes}: dp is single-process; fix: use trainer=ddp for several nodes"
            )
        self._num_nodes = num_nodes

    @property
    def parallel_devices(self) -> list[torch.device] | None:
        return self._parallel_devices

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        if devices:
            kinds = {d.type for d in devices}
            if len(kinds) > 1 or not kinds <= {"cpu", "cuda"}:
                raise ConfigError(f"dp runs on CPU threads or on CUDA devices of one kind, got {devices}; fix: give devices of one kind")
            if "cuda" in kinds and max(d.index or 0 for d in devices) >= torch.cuda.device_count():
                raise ConfigError(
                    f"dp was given {devices} but only {torch.cuda.device_count()} GPU(s) are visible; fix: "
                    "lower trainer.devices"
                )
        self._parallel_devices = devices

    # -- one process: ranks and collectives are trivial --------------------------------------------
    @property
    def root_device(self) -> torch.device:
        if not self.parallel_devices:
            raise RuntimeError(
                "DataParallelStrategy has no devices yet: the Trainer sets them from trainer.devices"
            )
        return self.parallel_devices[0]

    @property
    def global_rank(self) -> int:
        return 0

    @property
    def local_rank(self) -> int:
        return 0

    @property
    def node_rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        # One replica: the DataModule hands the whole global batch to the strategy, which splits it.
        return {"num_replicas": 1, "rank": 0}

    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any | None = "mean"
    ) -> Tensor | Any:
        return tensor

    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        return tensor

    def barrier(self, name: str | None = None) -> None:
        pass

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return decision

    # -- lifecycle ---------------------------------------------------------------------------------
    def check_before_launch(self, trainer: pl.Trainer, model: pl.LightningModule,
                            datamodule: pl.LightningDataModule | None = None) -> None:
        """What dp checks before training (:func:`src.engine.strategies.launchers.preflight`): the model, then that
        every device gets a sample of any DataModule's batch (else the first training step fails)."""
        self._check_model(model)
        if (getattr(model, "hparams", None) or {}).get("compile"):  # a StepModule compiles its net in setup
            _refuse_bound_forwards(["net (model.compile=true)"])
        hparams = getattr(datamodule, "hparams", None) or {}
        check_dp_batch(hparams.get("batch_size", getattr(datamodule, "batch_size", None)), len(self.parallel_devices))

    def _check_model(self, model: pl.LightningModule) -> None:
        missing = missing_members(model, STEP_MEMBERS)  # the StepProtocol (src/engine/strategies/protocols.py)
        if missing:
            raise ConfigError(protocol_error("dp", model, STEP_MEMBERS, missing))
        if not model.automatic_optimization:
            raise ConfigError(
                f"{type(model).__name__} uses manual optimization, which dp does not support "
                "(it drives model_step/record_step itself); fix: use a single device or trainer=ddp"
            )
        if compat.layer_sync_of(self) is not None:
            raise ConfigError(
                "trainer.sync_batchnorm=true needs a process group and does not apply to dp (each shard "
                "normalizes separately, as in nn.DataParallel); fix: set trainer.sync_batchnorm=false or use trainer=ddp"
            )

    def connect(self, model: pl.LightningModule) -> None:
        self._check_model(model)  # dp starts no processes: attaching the model is still before any work
        super().connect(model)

    def setup(self, trainer: pl.Trainer) -> None:
        # After LightningModule.setup, so a compiled net is visible here, before training.
        bound = compat.bound_forwards(self.lightning_module)
        if bound:
            _refuse_bound_forwards(bound)
        super().setup(trainer)
        self._runner = ShardRunner(len(self.parallel_devices))
        _seed_devices_apart(self.parallel_devices)

    def model_to_device(self) -> None:
        self.lightning_module.to(self.root_device)

    def teardown(self) -> None:
        if self._runner is not None:
            self._runner.close()
            self._runner = None
        super().teardown()

    # -- the steps ---------------------------------------------------------------------------------
    def training_step(self, batch: Any, *args: Any, **kwargs: Any) -> Tensor:
        return self._parallel_step("train", batch, self.precision_plugin.train_step_context)

    def validation_step(self, batch: Any, *args: Any, **kwargs: Any) -> None:
        self._parallel_step("val", batch, self.precision_plugin.val_step_context)

    def test_step(self, batch: Any, *args: Any, **kwargs: Any) -> None:
        self._parallel_step("test", batch, self.precision_plugin.test_step_context)

    def _parallel_step(self, stage: str, batch: Any, context: Callable[[], AbstractContextManager]) -> Tensor:
        """Scatter ``batch``, run ``model_step`` on every shard in parallel, gather, ``record_step`` once."""
        module = self.lightning_module
        devices = self.parallel_devices
        size = batch_size_of(batch)
        if size < len(devices):
            if stage == "train":
                raise ConfigError(
                    f"batch of {size} samples cannot be split across {len(devices)} dp devices; fix: raise data.batch_size"
                )
            devices = devices[:size]  # a short last eval batch runs on fewer devices, like nn.DataParallel
        sizes = shard_sizes(size, len(devices))
        shards = [move_data_to_device(s, d) for s, d in zip(split_batch(batch, sizes), devices, strict=True)]
        with context():
            replicas = make_replicas(module, devices)
            outputs = self._runner.run(_model_step, list(zip(replicas, shards, strict=True)), devices)
            gathered = gather_step_outputs(outputs, sizes, self.root_device)
            return module.record_step(stage, gathered)


def _model_step(replica: pl.LightningModule, shard: Any) -> Any:
    return replica.model_step(shard)


def _seed_devices_apart(devices: list[torch.device]) -> None:
    """Give each CUDA device its own random stream (seed + device position), so equal-sized shards on
    different GPUs draw different dropout masks. CPU shards share one generator already."""
    if devices and devices[0].type == "cuda":
        base = torch.cuda.initial_seed()
        for offset, device in enumerate(devices[1:], start=1):
            torch.cuda.default_generators[device.index].manual_seed(base + offset)
