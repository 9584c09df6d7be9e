"""``fsdp``: fully sharded data parallel (FSDP2, ``fully_shard``) with the guarantees of ``trainer=ddp``.

Lightning 2.6 runs FSDP2 through its ``ModelParallelStrategy``; its ``FSDPStrategy`` is FSDP1, which torch
2.14 no longer builds without an accelerator. This subclass of the former:

* **shards** any LightningModule over all ranks by a wrap policy (:mod:`.wrap`, ``wrap``): ``model.net``'s named
  blocks, submodules of some classes, or of at least ``wrap_min_params`` parameters, one ``fully_shard`` unit
  each, inside one root unit per top-level submodule; so parameters, gradients and optimizer state each take
  about 1/N per rank; ``sharding_strategy`` picks
  ``full``, ``grad_op`` (blocks stay gathered from forward to backward) or ``hybrid`` (sharded within
  groups of ``hybrid_shard_size`` ranks, replicated across them);
* is **data parallel** like DDP: every rank is a replica for the sampler and the global-batch rule, and
  torchmetrics states sync over all ranks; buffers (BatchNorm statistics) follow global rank 0 before each
  training step, as DDP's ``broadcast_buffers``;
* **mixed precision** comes from ``trainer.precision`` (``bf16-mixed``: bf16 all-gathers and compute,
  float32 gradient reduction); ``cpu_offload`` keeps shards and optimizer state on the host (GPU runs);
* **checkpoints** are sharded folders by default, written atomically and read on any number of ranks or
  by one process (:mod:`src.engine.checkpointing.sharded`); ``state_dict_type=full`` writes one DDP-style file;
* shares DDP's **process life** (:mod:`src.engine.strategies.process_life`): pre-flight launcher (python, torchrun,
  srun, ``-m`` sweeps), SIGTERM agreement, dead/frozen-rank watchdog, file rendezvous, restart namespace,
  exit cleanup.
"""

from __future__ import annotations

import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from omegaconf import DictConfig
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.optim import Optimizer

from src.engine.checkpointing.io import AtomicCheckpointIODefault
from src.engine.checkpointing.sharded import is_sharded_checkpoint, replace, save_sharded, to_layout
from src.engine.runtime.exit_cleanup import release_before_destroy
from src.engine.runtime.loader_workers import WorkersOutliveStopSignals
from src.engine.runtime.sigterm import install_sigterm_agreement
from src.engine.strategies.fsdp import checkpoint as ckpt
from src.engine.strategies.fsdp.wrap import (
    DEFAULT_MIN_PARAMS,
    SHARDING_STRATEGIES,
    check_shardable,
    fsdp_units,
    mixed_precision,
    resolve_sharding,
    resolve_wrap,
    shard_module,
)
from src.engine.strategies.launchers import PreflightSubprocessLauncher
from src.engine.strategies.options import refuse_foreign_options
from src.engine.strategies.process_life import ProcessLife, collective_timeout
from src.engine.utils import lightning_compat as compat
from src.engine.utils.errors import ConfigError

STATE_DICT_TYPES = ("sharded", "full")
PRECISIONS = ("32-true", "32", "bf16-mixed", "bf16", "bf16-true", "16-true")  # Lightning's ModelParallel set


class FSDPStrategy(WorkersOutliveStopSignals, compat.BuildsLauncher, AtomicCheckpointIODefault, ProcessLife, ModelParallelStrategy):
    """FSDP2 over ``trainer.devices x num_nodes`` processes, sharded by a wrap policy (:mod:`.wrap`).

    Args:
        wrap: ``auto`` (``blocks`` for a module with an nn.Sequential ``net``, else ``size``), ``blocks``, ``size``,
            or a list of classes (import paths or class names, e.g. ``[torch.nn.Linear]``).
        wrap_min_params: ``size``: a submodule becomes a unit once it holds this many parameters not in a unit below.
        sharding_strategy: ``full``, ``grad_op`` or ``hybrid``.
        hybrid_shard_size: ranks per shard group under ``hybrid``; ``None`` = the processes of one node.
        cpu_offload: keep parameter shards, gradients and optimizer state on the host (needs GPUs).
        state_dict_type: ``sharded`` (a folder of shards) or ``full`` (one file, gathered on global rank 0).
        process_group_backend: ``None`` = nccl on CUDA, gloo otherwise.
        timeout, hang_timeout_s, sigterm_check_every_n_batches: as :class:`~src.engine.strategies.ddp.DDPStrategy`.
    """

    strategy_name = "fsdp"
    names_every_option = True  # its constructor passes none of its bases' options on (src/engine/strategies/options.py)

    def __init__(self, sharding_strategy: str = "full", hybrid_shard_size: int | None = None, wrap: Any = "auto",
                 wrap_min_params: int = DEFAULT_MIN_PARAMS,
                 cpu_offload: bool = False, state_dict_type: str = "sharded", process_group_backend: str | None = None,
                 timeout: timedelta | float | None = None, hang_timeout_s: float | None = 120.0,
                 sigterm_check_every_n_batches: int = 10, **unknown: Any) -> None:
        refuse_foreign_options(type(self), unknown)
        if state_dict_type not in STATE_DICT_TYPES:
            raise ConfigError(f"trainer.strategy.state_dict_type={state_dict_type!r} is not a checkpoint format; fix: "
                              "sharded (a folder of shards) or full (one file)")
        if hybrid_shard_size is not None and (isinstance(hybrid_shard_size, bool)
                                              or not isinstance(hybrid_shard_size, int) or hybrid_shard_size < 1):
            raise ConfigError(f"trainer.strategy.hybrid_shard_size={hybrid_shard_size!r} must be an integer >= 1; fix: "
                              "e.g. 2, or null for the processes of one node")
        timeout = collective_timeout(timeout)
        super().__init__(save_distributed_checkpoint=state_dict_type == "sharded",
                         process_group_backend=process_group_backend, timeout=timeout)
        self.init_process_life(sigterm_check_every_n_batches, hang_timeout_s, timeout, process_group_backend)
        self.sharding_strategy = resolve_sharding(sharding_strategy)
        self.wrap_policy = resolve_wrap(wrap, wrap_min_params)
        self.hybrid_shard_size = hybrid_shard_size
        self.cpu_offload = bool(cpu_offload)
        self.state_dict_type = state_dict_type
        self.shard_mesh: DeviceMesh | None = None

    # -- sizes and checks before any process starts -------------------------------------------------
    @property
    def processes(self) -> int:
        return self.num_nodes * self.num_processes

    @property
    def shard_size(self) -> int:
        """Ranks that share one copy of the model: all of them, or one hybrid group."""
        if self.sharding_strategy != "hybrid":
            return self.processes
        return self.hybrid_shard_size or self.num_processes

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.processes, "rank": self.global_rank}  # every rank reads its own data

    @classmethod
    def check_trainer_config(cls, trainer_cfg: DictConfig) -> None:
        """Before the Trainer is built (Lightning would refuse the precision there, with a traceback)."""
        precision = str(trainer_cfg.get("precision", "32-true"))
        if precision not in PRECISIONS:
            raise ConfigError(f"trainer.precision={precision} is not supported by trainer=fsdp (Lightning's FSDP2 "
                              "runs no gradient scaler for float16); fix: use bf16-mixed, bf16-true or 32-true")

    def check_before_launch(self, trainer: pl.Trainer, model: pl.LightningModule,
                            datamodule: pl.LightningDataModule | None = None) -> None:
        """What fsdp checks before any rank starts (:func:`src.engine.strategies.launchers.preflight`): the model, then the
        mesh, then the options."""
        check_shardable(model, self.wrap_policy)
        if self.processes % self.shard_size:
            raise ConfigError(f"trainer=fsdp cannot split {self.processes} processes into hybrid shard groups of "
                              f"{self.shard_size}; fix: make trainer.strategy.hybrid_shard_size divide trainer.devices "
                              "x trainer.num_nodes")
        if self.cpu_offload and self.root_device.type != "cuda":
            raise ConfigError("trainer.strategy.cpu_offload=true moves GPU shards to the host, and this run is on "
                              "the CPU already; fix: set trainer.strategy.cpu_offload=false")
        if compat.layer_sync_of(self) is not None and self.root_device.type != "cuda":
            raise ConfigError("trainer.sync_batchnorm=true needs CUDA GPUs (torch's SyncBatchNorm is GPU-only); "
                              "fix: set trainer.sync_batchnorm=false on CPU")

    def build_launcher(self) -> PreflightSubprocessLauncher:
        """Lightning's launcher for ModelParallelStrategy (popen, or the ranks torchrun/srun started), pre-flight added."""
        self.follow_torchrun_nodes()
        return PreflightSubprocessLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    # -- process group and sharding ------------------------------------------------------------------
    def setup_environment(self) -> None:
        compat.set_mesh_sizes(self, self.processes, 1)  # every rank data parallel; no tensor parallelism
        self.accelerator.setup_device(self.root_device)
        self.join_process_group()
        super().setup_environment()  # Lightning keeps a group that is already up, and builds its mesh
        release_before_destroy(self._release_groups)
        self.watch_process_group()

    def _release_groups(self) -> None:
        """Drop the meshes' sub-groups, so destroying the group at exit joins their threads (as the pipeline does).

        Lightning's mesh is a root, and the shard mesh a slice of it or a root of its own: both hold all groups."""
        for mesh in (self._device_mesh_or_none(), self.shard_mesh):
            if mesh is not None:
                compat.forget_mesh_groups(mesh)
        self.shard_mesh = None

    def _device_mesh_or_none(self) -> DeviceMesh | None:
        try:
            return self.device_mesh
        except RuntimeError:  # Lightning's mesh is built in setup_environment
            return None

    def _mesh_to_shard_over(self) -> DeviceMesh:
        if self.sharding_strategy != "hybrid":
            return self.device_mesh["data_parallel"]
        replicas = self.processes // self.shard_size
        return init_device_mesh(self.root_device.type, (replicas, self.shard_size),
                                mesh_dim_names=("replicate", "shard"))

    def setup(self, trainer: pl.Trainer) -> None:
        """Convert (``*-true`` precision), move, shard by the wrap policy; then optimizers over the shards.

        Not ModelParallelStrategy.setup, which needs the model's own ``configure_model``: the strategy shards.
        """
        self.accelerator.setup(trainer)
        module = self.lightning_module
        if not fsdp_units(module):  # a later test/validate reuses the sharded module
            check_shardable(module, self.wrap_policy)
            layer_sync = compat.layer_sync_of(self)
            if layer_sync is not None:
                self.model = layer_sync.apply(self.model)
            self.model = self.precision_plugin.convert_module(self.model)
            self.model_to_device()
            self.shard_mesh = self._mesh_to_shard_over()
            plan = shard_module(module, self.shard_mesh, SHARDING_STRATEGIES[self.sharding_strategy],
                                mixed_precision(str(getattr(self.precision_plugin, "precision", ""))), self.cpu_offload,
                                self.wrap_policy)
            rank_zero_info(f"trainer=fsdp: {plan.describe()}")
        self.barrier()
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting and not self.cpu_offload:  # offloaded optimizer state stays on the host
            compat.optimizers_to_device(self.optimizers, self.root_device)
        install_sigterm_agreement(trainer, self.sigterm_check_every_n_batches)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._follow_rank_zero_buffers()
        return super().training_step(*args, **kwargs)

    def _follow_rank_zero_buffers(self) -> None:
        """Buffers (BatchNorm statistics) from global rank 0, as DDP's ``broadcast_buffers`` does before a step."""
        if self.world_size > 1:
            for buffer in self.lightning_module.buffers():
                dist.broadcast(buffer, src=0)

    # -- checkpoints -----------------------------------------------------------------------------------
    @property
    def full_state_dict(self) -> bool:
        return self.state_dict_type == "full"

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Every rank calls it. Buffers first follow global rank 0, as a DDP checkpoint holds rank 0's: a sharded
        save writes a replicated tensor (BatchNorm statistics) from whichever rank it picks."""
        self._follow_rank_zero_buffers()
        return ckpt.model_state(self.model, self.full_state_dict)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        optimizer = getattr(optimizer, "optimizer", optimizer)  # a LightningOptimizer wraps the torch one
        return ckpt.optimizer_state(self.model, optimizer, self.full_state_dict, self.is_global_zero)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | Path,
                        storage_options: Any | None = None) -> None:
        """Sharded: every rank writes its shards into a temp folder, swapped in atomically; full: one file."""
        path = Path(self.broadcast(str(filepath)))  # rank 0's path: every rank writes into the same folder
        if self.full_state_dict:
            if not self.is_global_zero:
                return
            if not path.is_dir():
                self.checkpoint_io.save_checkpoint(checkpoint, path, storage_options)
                return
            tmp = path.with_name(f".{path.name}.full")  # a sharded folder was there: swap the file in whole
            self.checkpoint_io.save_checkpoint(checkpoint, tmp, storage_options)
            replace(tmp, path)
            return
        tensors, meta = to_layout(checkpoint)
        save_sharded(tensors, meta, path, self.is_global_zero, lambda obj: self.broadcast(obj), self.barrier)

    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        """A sharded folder (written by any number of ranks) or a full file, into this rank's shards."""
        path = Path(self.broadcast(str(checkpoint_path)))
        return ckpt.load_into(self.model, [getattr(o, "optimizer", o) for o in self.optimizers], path,
                              strict=self.lightning_module.strict_loading)

    def remove_checkpoint(self, filepath: str | Path) -> None:
        """A checkpoint ModelCheckpoint no longer keeps: a sharded folder goes whole."""
        if not is_sharded_checkpoint(filepath):
            super().remove_checkpoint(filepath)
        elif self.is_global_zero:
            shutil.rmtree(filepath, ignore_errors=True)

    def teardown(self) -> None:
        super().teardown()
        self.shard_mesh = None
