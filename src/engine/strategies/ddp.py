"""``DDPStrategy``: Lightning's DDP with the project's fixes built in, so ``Trainer(strategy=DDPStrategy())``
behaves exactly like ``trainer=ddp``:

* its launcher (:mod:`src.engine.strategies.launchers`) runs the pre-flight checks before any rank starts, and
  under Hydra starts each child rank with *this job's* command (a multirun would otherwise replay the
  whole sweep per rank);
* a SIGTERM reaching any rank stops every rank at the same batch, agreed every
  ``sigterm_check_every_n_batches`` batches (:mod:`src.engine.runtime.sigterm`);
* a stop signal (SIGTERM, SIGUSR1) saves ``last.ckpt`` at that batch and exits 128 + signal;
* checkpoints are written atomically and loaded with ``weights_only=True``
  (:mod:`src.engine.checkpointing.io`), unless another CheckpointIO is given;
* a collective waits at most ``timeout`` (10 minutes) for a busy peer;
* a rank that dies, freezes or gets stuck (in a collective its peers never join, or a blocking call) ends
  every rank soon, with one line naming it; a stuck rank's collectives are written by torch's flight
  recorder to ``<run dir>/flight_recorder/rank_<N>.json`` (:mod:`src.engine.runtime.flight_recorder`);
* a one-node run rendezvous through a file and gloo binds to loopback (:mod:`src.engine.runtime.local_store`);
* a torchrun restart does not read the keys of the attempt before it (:mod:`src.engine.runtime.elastic_restart`);
* the process group is destroyed before the interpreter exits (:mod:`src.engine.runtime.exit_cleanup`).

The process-life pieces live in :class:`src.engine.strategies.process_life.ProcessLife`, shared with ``trainer=fsdp``.

Everything else (cluster environments, gradient sync, torchrun/SLURM detection) is Lightning's own.
"""

from __future__ import annotations

import inspect
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy

from src.engine.checkpointing.io import AtomicCheckpointIODefault
from src.engine.runtime.loader_workers import WorkersOutliveStopSignals
from src.engine.runtime.sigterm import install_sigterm_agreement
from src.engine.strategies.launchers import PreflightMultiprocessingLauncher, PreflightSubprocessLauncher
from src.engine.strategies.options import refuse_foreign_options
from src.engine.strategies.process_life import ProcessLife, collective_timeout
from src.engine.utils import lightning_compat as compat
from src.engine.utils.errors import ConfigError


class DDPStrategy(WorkersOutliveStopSignals, compat.BuildsLauncher, AtomicCheckpointIODefault, ProcessLife, LightningDDPStrategy):
    """Lightning's :class:`~lightning.pytorch.strategies.DDPStrategy` plus the fixes above.

    Args:
        sigterm_check_every_n_batches: how often the ranks agree on a SIGTERM (1 = every batch).
        hang_timeout_s: a rank whose heartbeat stops this long (frozen, or gone from another host), or that
            the others have waited for this long while no rank made progress (stuck), ends the job
            (:mod:`src.engine.runtime.watchdog`); a dead rank is seen within a second on its host. It must exceed
            the longest pause between batches (e.g. writing a checkpoint). ``None`` turns the watchdog off.
        timeout: how long a collective waits for a busy peer (``timedelta`` or seconds; ``None``: 10 min).
        **kwargs: Lightning's DDPStrategy arguments.
    """

    strategy_name = "ddp"  # the trainer= config that builds it (ddp_spawn too)
    runs_owned_step = True  # the module may own its training step (src/engine/steps/owned_step.py)

    def __init__(self, *args: Any, sigterm_check_every_n_batches: int = 10, hang_timeout_s: float | None = 120.0,
                 timeout: timedelta | float | None = None, **kwargs: Any) -> None:
        refuse_foreign_options(type(self), kwargs)
        timeout = collective_timeout(timeout)
        super().__init__(*args, timeout=timeout, **kwargs)
        given = ddp_arguments(self, *args, timeout=timeout, **kwargs)
        self.start_method = given["start_method"]  # popen, spawn, fork, forkserver
        # post-local SGD averages the parameters after each optimizer step (read by the owned step)
        self.averages_models = given["model_averaging_period"] is not None
        self.init_process_life(sigterm_check_every_n_batches, hang_timeout_s, timeout,
                               kwargs.get("process_group_backend"))

    def build_launcher(self) -> PreflightSubprocessLauncher | PreflightMultiprocessingLauncher:
        """Lightning's choice of launcher (as its own DDPStrategy makes it), with the pre-flight added."""
        self.follow_torchrun_nodes()
        start_method = self.start_method
        if start_method == "popen":
            return PreflightSubprocessLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        return PreflightMultiprocessingLauncher(self, start_method=start_method)

    def check_before_launch(self, trainer: pl.Trainer, model: pl.LightningModule,
                            datamodule: pl.LightningDataModule | None = None) -> None:
        """What this strategy checks before any rank starts (:func:`src.engine.strategies.launchers.preflight`)."""
        if self.start_method in ("fork", "forkserver") and torch.cuda.is_initialized():
            raise ConfigError("trainer.strategy.start_method=fork: CUDA is already initialized in this process, and a "
                              "forked rank cannot use it; fix: use trainer=ddp (or ddp_spawn) on GPUs")
        if compat.layer_sync_of(self) is not None and self.root_device.type != "cuda":
            raise ConfigError("trainer.sync_batchnorm=true needs CUDA GPUs (torch's SyncBatchNorm is GPU-only); fix: "
                              "set trainer.sync_batchnorm=false on CPU")

    def setup_distributed(self) -> None:
        self.join_process_group()
        super().setup_distributed()  # Lightning keeps a group that is already up
        self.watch_process_group()

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        install_sigterm_agreement(trainer, self.sigterm_check_every_n_batches)


def ddp_arguments(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """The arguments Lightning's DDPStrategy takes from these, by name (its own defaults where not given)."""
    bound = inspect.signature(LightningDDPStrategy.__init__).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.arguments
