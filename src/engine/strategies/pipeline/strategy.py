"""``pipeline``: model-parallel pipeline training for Lightning 2.x on ``torch.distributed.pipelining``.

Lightning ships no pipeline strategy (its ``ModelParallelStrategy`` covers FSDP2 and tensor
parallelism). This one builds on :class:`~src.engine.strategies.ddp.DDPStrategy` (Lightning's DDP) for what
does not change (launcher, process group, cluster environments) and replaces the rest:

* **split** (``setup``): ``model.net``'s named blocks are cut into ``stages x stages_per_rank``
  contiguous stages balanced by parameters or forward time; every rank deletes the blocks it
  does not hold, so ``configure_optimizers`` sees only local parameters (each stage steps its
  own optimizer). Replicas of a stage are synchronised from data-parallel rank 0.
* **step**: ``training_step`` runs the schedule (GPipe, 1F1B or Interleaved1F1B), which does
  forward *and* backward per micro-batch with ``loss_fn = criterion``; the last stage's output
  and mean loss are broadcast over the pipeline so ``record_step`` logs identical values on
  every rank. Evaluation runs the same pipeline forward-only.
* **gradients**: Lightning zeroes gradients between ``training_step`` and ``backward``, so the
  schedule's gradients are parked and re-added in ``backward`` (:mod:`.grads`), after
  averaging them over the stage's data-parallel replicas.
* **metrics**: every rank of a pipeline holds the same outputs, so torchmetrics states and
  ``sync_dist`` logging are reduced over the data-parallel group only: a world-wide sync would
  count each sample once per stage.
* **checkpoints**: one full-model file (:mod:`.checkpoint`), loadable on a single device.

Layout: ``world = stages x dp_size``; global rank ``r`` is pipeline rank ``r % stages`` of
replica ``r // stages`` (:mod:`.mesh`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from rich.console import Console
from torch import Tensor, nn
from torchmetrics import Metric

from src.engine.runtime.exit_cleanup import release_before_destroy
from src.engine.runtime.sigterm import install_sigterm_agreement
from src.engine.strategies.ddp import DDPStrategy
from src.engine.strategies.pipeline import checkpoint as ckpt
from src.engine.strategies.pipeline.grads import add_grads, reduce_grads, take_grads
from src.engine.strategies.pipeline.mesh import Layout, PipelineMesh, build_mesh, resolve_layout
from src.engine.strategies.pipeline.partition import (
    BALANCE_MODES,
    StageSpec,
    named_blocks,
    plan_stages,
    split_table,
    time_costs,
)
from src.engine.strategies.pipeline.runner import PipelineRunner
from src.engine.strategies.pipeline.schedule import canonical_schedule, check_schedule, stage_indices
from src.engine.strategies.protocols import PIPELINE_MEMBERS, missing_members, protocol_error
from src.engine.utils import lightning_compat as compat
from src.engine.utils.errors import ConfigError


def _sync_metrics_over(module: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Point every torchmetrics state in ``module`` at ``group`` (``None``: the default group)."""
    for metric in module.modules():
        if isinstance(metric, Metric):
            metric.process_group = group


class PipelineStrategy(DDPStrategy):
    """Pipeline parallelism (optionally times data parallelism) over ``trainer.devices x num_nodes`` processes.

    Args:
        stages: pipeline ranks per replica; ``None`` = processes / ``dp_size``.
        n_microbatches: micro-batches per (per-replica) batch; must divide training batches.
        schedule: ``GPipe``, ``1F1B`` or ``Interleaved1F1B``.
        stages_per_rank: virtual stages per pipeline rank (``Interleaved1F1B`` needs >= 2).
        dp_size: data-parallel replicas of the whole pipeline.
        balance: ``params`` (parameter counts) or ``time`` (measured forward time per block).
        process_group_backend: ``None`` = gloo on CPU, nccl on CUDA.
        start_method: ``popen`` (re-run the script per rank) or ``spawn``.
        **kwargs: the project's :class:`~src.engine.strategies.ddp.DDPStrategy` arguments (``timeout``,
            ``hang_timeout_s``, ``sigterm_check_every_n_batches``...).
    """

    strategy_name = "pipeline"
    runs_owned_step = False  # the schedule runs forward and backward itself

    def __init__(
        self,
        stages: int | None = None,
        n_microbatches: int = 4,
        schedule: str = "1F1B",
        stages_per_rank: int = 1,
        dp_size: int = 1,
        balance: str = "params",
        process_group_backend: str | None = None,
        start_method: str = "popen",
        **kwargs: Any,
    ) -> None:
        schedule = canonical_schedule(schedule)
        check_schedule(schedule, n_microbatches, stages_per_rank)
        if balance not in BALANCE_MODES:
            raise ConfigError(f"trainer.strategy.balance={balance!r} is unknown; fix: use one of {', '.join(BALANCE_MODES)}")
        if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
            raise ConfigError(f"trainer.strategy.dp_size={dp_size!r} is not an integer >= 1; fix: set one")
        if stages is not None and (isinstance(stages, bool) or not isinstance(stages, int) or stages < 1):
            raise ConfigError(f"trainer.strategy.stages={stages!r} is not an integer >= 1; fix: set one, or null")
        super().__init__(process_group_backend=process_group_backend, start_method=start_method, **kwargs)
        self.stages = stages
        self.n_microbatches = n_microbatches
        self.schedule = schedule
        self.stages_per_rank = stages_per_rank
        self.dp_size = dp_size
        self.balance = balance
        self._layout: Layout | None = None
        self._mesh: PipelineMesh | None = None
        self._plan: list[StageSpec] | None = None
        self._split_net: nn.Module | None = None  # the net this rank has split (identity, to split once)
        self._runner: PipelineRunner | None = None
        self._block_order: list[str] = []
        self._full_param_names: list[str] = []  # the unsplit model's trainable parameters, in order
        self._pending_grads: list[Tensor | None] | None = None

    # -- layout and checks before any process starts --------------------------------------------
    @property
    def layout(self) -> Layout:
        """``pp x dp`` over the trainer's processes (known once the Trainer has set devices and nodes)."""
        world = self.num_nodes * self.num_processes
        if self._layout is None or self._layout.pp * self._layout.dp != world:
            self._layout = resolve_layout(world, self.stages, self.dp_size)
        return self._layout

    @property
    def num_stages(self) -> int:
        """Total (virtual) stages: pipeline ranks x stages per rank."""
        return self.layout.pp * self.stages_per_rank

    def check_before_launch(self, trainer: pl.Trainer, model: pl.LightningModule,
                            datamodule: pl.LightningDataModule | None = None) -> None:
        """What the pipeline checks before any rank starts (:func:`src.engine.strategies.launchers.preflight`), root
        causes first: the model, then whether it splits into the stages, then the schedule and the settings."""
        if trainer.state.fn == TrainerFn.PREDICTING:
            raise ConfigError("trainer=pipeline does not predict; fix: load the checkpoint on one device (trainer=default)")
        missing = missing_members(model, PIPELINE_MEMBERS)  # the PipelineProtocol (src/engine/strategies/protocols.py)
        if missing:
            raise ConfigError(protocol_error("pipeline", model, PIPELINE_MEMBERS, missing))
        if not model.automatic_optimization:
            raise ConfigError("trainer=pipeline runs backward inside the schedule, so manual optimization cannot; fix: use "
                              "automatic optimization (model.owned_step=false), or another trainer")
        if getattr(model.hparams, "compile", False):
            raise ConfigError("trainer=pipeline cannot split a compiled net; fix: set model.compile=false")
        n_blocks = len(self._block_order) if model.net is self._split_net else len(named_blocks(model.net))
        if n_blocks < self.num_stages:
            raise ConfigError(
                f"model.net has {n_blocks} blocks, fewer than the {self.num_stages} pipeline stages "
                f"({self.layout.pp} ranks x stages_per_rank={self.stages_per_rank}); fix: use fewer stages or more blocks"
            )
        check_schedule(self.schedule, self.n_microbatches, self.stages_per_rank, self.layout.pp)
        if getattr(self.precision_plugin, "scaler", None) is not None:
            raise ConfigError("trainer.precision=16-mixed needs loss scaling, which pipeline schedules do not do; fix: "
                              "use bf16-mixed or 32-true")
        if trainer.gradient_clip_val and trainer.gradient_clip_algorithm != "value":
            raise ConfigError("gradient norm clipping would see only one stage's gradients under trainer=pipeline; fix: "
                              "set trainer.gradient_clip_algorithm=value, or unset gradient_clip_val")
        if compat.layer_sync_of(self) is not None:
            raise ConfigError("trainer.sync_batchnorm=true is not supported with trainer=pipeline; fix: set it to false")

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Only data-parallel replicas get different data: all stages of one pipeline read the same batches.
        dp_rank, _ = self.layout.coords(self.global_rank)
        return {"num_replicas": self.layout.dp, "rank": dp_rank}

    # -- process groups and model split ----------------------------------------------------------
    def setup_environment(self) -> None:
        super().setup_environment()
        if self._mesh is None:
            self._mesh = build_mesh(self.root_device.type, self.layout)
            release_before_destroy(self._release_groups)

    def _release_groups(self) -> None:
        """Drop this strategy's references to the mesh's sub-groups, so destroying the group joins their threads."""
        module = self.lightning_module
        if module is not None:
            _sync_metrics_over(module, None)
        self._mesh = self._runner = None

    def setup(self, trainer: pl.Trainer) -> None:
        """Split on the host, then move only this rank's blocks to its device (no full model on any GPU).

        Not ``DDPStrategy.setup``: a pipeline is never wrapped in DDP, and DDP's start-up sync of
        every parameter from rank 0 would fight the split (each stage holds different blocks).
        """
        self.accelerator.setup(trainer)
        module = self.lightning_module
        self.model = self.precision_plugin.convert_module(module)
        fresh = self._split(module, trainer)
        self.model_to_device()
        if fresh:  # on the device: an nccl group broadcasts CUDA tensors only
            self._sync_replicas(module.net)
        _sync_metrics_over(module, self._mesh.dp_group)  # see module docstring: over replicas, not stages
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            compat.optimizers_to_device(self.optimizers, self.root_device)
        install_sigterm_agreement(trainer, self.sigterm_check_every_n_batches)

    def _split(self, module: pl.LightningModule, trainer: pl.Trainer) -> bool:
        """Keep this rank's blocks in ``module.net`` and build the pipeline over them; False if already split."""
        net = module.net
        if net is self._split_net:
            return False
        self._block_order = [name for name, _ in named_blocks(net)]
        self._plan = self._make_plan(net, trainer)
        self._full_param_names = [n for n, p in module.named_parameters() if p.requires_grad]
        mesh = self._mesh
        local = stage_indices(mesh.pp_rank, mesh.layout.pp, self.stages_per_rank)
        keep = {b for s in local for b in self._plan[s].blocks}
        for name in self._block_order:
            if name not in keep:
                delattr(net, name)
        modules = [
            (s, nn.Sequential(OrderedDict((b, getattr(net, b)) for b in self._plan[s].blocks))) for s in local
        ]
        self._split_net = net
        self._runner = PipelineRunner(modules, self.num_stages, mesh, self.root_device, self.schedule,
                                      self.n_microbatches, module.criterion)
        self._print_plan()
        return True

    def _make_plan(self, net: nn.Module, trainer: pl.Trainer) -> list[StageSpec]:
        if self.balance == "params":
            return plan_stages(net, self.num_stages)
        plan = None
        if self.global_rank == 0:  # timings differ per process: measure once, share the split
            costs = time_costs(named_blocks(net), self._example_input(trainer))
            plan = plan_stages(net, self.num_stages, costs)
        return self.broadcast(plan, src=0)

    def _example_input(self, trainer: pl.Trainer) -> Tensor:
        module = self.lightning_module
        example = getattr(module, "example_input_array", None)
        if isinstance(example, Tensor):
            return self.precision_plugin.convert_input(example.to(self.root_device))
        if trainer.datamodule is None:
            raise ConfigError("balance=time needs an example input; fix: set the module's example_input_array or train "
                              "with a DataModule")
        batch = next(iter(trainer.datamodule.train_dataloader()))
        return self.precision_plugin.convert_input(self.batch_to_device(batch)[0])

    def _sync_replicas(self, net: nn.Module) -> None:
        """Copy this stage's parameters and buffers from data-parallel rank 0 (as DDP does at wrap time)."""
        if self.layout.dp == 1:
            return
        src = self.layout.global_rank(0, self._mesh.pp_rank)
        with torch.no_grad():
            for tensor in [*net.parameters(), *net.buffers()]:
                dist.broadcast(tensor.data, src=src, group=self._mesh.dp_group)

    @rank_zero_only
    def _print_plan(self) -> None:
        layout = self.layout
        holders = [layout.replicas_of(s % layout.pp) for s in range(self.num_stages)]
        Console().print(split_table(self._plan, holders, self.balance))

    # -- steps -------------------------------------------------------------------------------------
    def _local_params(self) -> list[nn.Parameter]:
        return [p for p in self.lightning_module.parameters() if p.requires_grad]

    def training_step(self, batch: Any, batch_idx: int | None = None, *args: Any, **kwargs: Any) -> Tensor:
        inputs, target = batch
        params = self._local_params()
        accumulated = take_grads(params)  # what Lightning accumulated so far stays out of the schedule's way
        with self.precision_plugin.train_step_context():
            out = self._runner.train_step(inputs, target)
        self._pending_grads = take_grads(params)  # re-added in backward(), after Lightning's zero_grad
        add_grads(params, accumulated)
        return self.lightning_module.record_step("train", out)

    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """No autograd call: the schedule already did backward. Average and hand over its gradients."""
        module = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        grads, self._pending_grads = self._pending_grads, None
        if grads is not None:
            # Lightning divides the loss by accumulate_grad_batches before backward: do the same to the gradients.
            divisor = self.layout.dp * module.trainer.accumulate_grad_batches
            reduce_grads(grads, self._mesh.dp_group if self.layout.dp > 1 else None, divisor)
            add_grads(self._local_params(), grads)
        return self.precision_plugin.post_backward(closure_loss, module)

    def validation_step(self, batch: Any, batch_idx: int | None = None, *args: Any, **kwargs: Any) -> None:
        with self.precision_plugin.val_step_context():
            out = self._runner.eval_step(*batch)
        self.lightning_module.record_step("val", out)

    def test_step(self, batch: Any, batch_idx: int | None = None, *args: Any, **kwargs: Any) -> None:
        with self.precision_plugin.test_step_context():
            out = self._runner.eval_step(*batch)
        self.lightning_module.record_step("test", out)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        raise ConfigError("trainer=pipeline does not predict; fix: load the checkpoint on one device (trainer=default)")

    # -- reductions: data-parallel group by default (see module docstring) ------------------------
    def reduce(self, tensor: Tensor, group: Any | None = None, reduce_op: Any = "mean") -> Tensor:
        if group is None and self._mesh is not None:
            group = self._mesh.dp_group
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        # Callbacks' decisions (stop, save) must agree across every process: reduce over the world.
        votes = self.reduce(torch.tensor(int(decision), device=self.root_device), group=dist.group.WORLD,
                            reduce_op="sum")
        return bool(votes == self.world_size) if all else bool(votes)

    # -- checkpoints: one full-model file (see .checkpoint) ----------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._split_net is None:
            return self.lightning_module.state_dict()
        return ckpt.full_model_state(self.lightning_module, self._mesh, self._block_order)

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        return ckpt.full_optimizer_state(optimizer, self.lightning_module, self._mesh, self._block_order)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        module = self.lightning_module
        if self._split_net is not None and module.net is self._split_net:
            ckpt.load_local_model_state(module, checkpoint["state_dict"], strict)
        else:
            module.load_state_dict(checkpoint["state_dict"], strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        ckpt.load_local_optimizer_states(self.optimizers, checkpoint["optimizer_states"], self.lightning_module,
                                         self._full_param_names)
        compat.optimizers_to_device(self.optimizers, self.root_device)
