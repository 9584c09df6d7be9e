"""``DDPStrategy``: Lightning's DDP with the project's fixes built in, so ``Trainer(strategy=DDPStrategy())``
behaves exactly like ``trainer=ddp``:

* its launcher (:mod:`src.strategies.launchers`) runs the pre-flight checks before any rank starts, and
  under Hydra starts each child rank with *this job's* command (a multirun would otherwise replay the
  whole sweep per rank);
* a SIGTERM reaching any rank stops every rank at the same batch, agreed every
  ``sigterm_check_every_n_batches`` batches (:mod:`src.runtime.sigterm`);
* a stop signal (SIGTERM, SIGUSR1) saves ``last.ckpt`` at that batch and exits 128 + signal;
* checkpoints are written atomically and loaded with ``weights_only=True``
  (:mod:`src.utils.checkpoint_io`), unless another CheckpointIO is given;
* a collective waits at most ``timeout`` (10 minutes) for a busy peer;
* a rank that dies or freezes ends every rank soon, with one line naming it (:mod:`src.runtime.watchdog`);
* a one-node run rendezvous through a file and gloo binds to loopback (:mod:`src.runtime.local_store`);
* a torchrun restart does not read the keys of the attempt before it (:mod:`src.runtime.elastic_restart`);
* the process group is destroyed before the interpreter exits (:mod:`src.runtime.exit_cleanup`).

Everything else (cluster environments, gradient sync, torchrun/SLURM detection) is Lightning's own.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy
from torch.distributed import Store

from src.runtime.elastic_restart import init_group_of_this_attempt
from src.runtime.exit_cleanup import destroy_default_group_at_exit
from src.runtime.local_store import init_group_with_local_store
from src.runtime.sigterm import check_interval, install_sigterm_agreement
from src.runtime.watchdog import RankWatchdog
from src.strategies.launchers import PreflightMultiprocessingLauncher, PreflightSubprocessLauncher
from src.strategies.ps.layout import refuse_mixing
from src.utils import lightning_compat as compat
from src.utils.checkpoint_io import AtomicCheckpointIODefault
from src.utils.errors import ConfigError, user_error_cause
from src.utils.pylogger import RankedLogger

log = RankedLogger(__name__)


COLLECTIVE_TIMEOUT = timedelta(minutes=10)  # torch's default, 30 min, leaves a hung job idle for half an hour


class DDPStrategy(compat.BuildsLauncher, AtomicCheckpointIODefault, LightningDDPStrategy):
    """Lightning's :class:`~lightning.pytorch.strategies.DDPStrategy` plus the fixes above.

    Args:
        sigterm_check_every_n_batches: how often the ranks agree on a SIGTERM (1 = every batch).
        hang_timeout_s: a rank whose heartbeat stops this long (frozen, or gone from another host) ends
            the job (:mod:`src.runtime.watchdog`); a dead rank on the same host is seen within a second.
            ``None`` turns the watchdog off.
        timeout: how long a collective waits for a busy peer (``timedelta`` or seconds; ``None``: 10 min).
        **kwargs: Lightning's DDPStrategy arguments.
    """

    def __init__(self, *args: Any, sigterm_check_every_n_batches: int = 10, hang_timeout_s: float | None = 120.0,
                 timeout: timedelta | float | None = None, **kwargs: Any) -> None:
        refuse_mixing(getattr(self, "strategy_name", "ddp"), kwargs)
        if timeout is None:
            timeout = COLLECTIVE_TIMEOUT
        elif not isinstance(timeout, timedelta):
            timeout = timedelta(seconds=timeout)
        super().__init__(*args, timeout=timeout, **kwargs)
        self.sigterm_check_every_n_batches = check_interval(sigterm_check_every_n_batches)
        if hang_timeout_s is not None and hang_timeout_s <= 0:
            raise ConfigError(f"trainer.strategy.hang_timeout_s={hang_timeout_s!r} must be > 0 seconds, or null "
                              "to turn the watchdog off")
        self.hang_timeout_s = hang_timeout_s
        self.collective_timeout = timeout
        self.requested_backend: str | None = kwargs.get("process_group_backend")
        self.watchdog: RankWatchdog | None = None
        self.file_store: Store | None = None  # the one-node rendezvous (src/runtime/local_store.py)

    def build_launcher(self) -> PreflightSubprocessLauncher | PreflightMultiprocessingLauncher:
        """Lightning's choice of launcher (as its own DDPStrategy makes it), with the pre-flight added."""
        start_method = compat.start_method_of(self)
        if start_method == "popen":
            return PreflightSubprocessLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        return PreflightMultiprocessingLauncher(self, start_method=start_method)

    def check_before_launch(self, trainer: pl.Trainer, model: pl.LightningModule,
                            datamodule: pl.LightningDataModule | None = None) -> None:
        """What this strategy checks before any rank starts (:func:`src.strategies.launchers.preflight`)."""
        if compat.layer_sync_of(self) is not None and self.root_device.type != "cuda":
            raise ConfigError("trainer.sync_batchnorm=true needs CUDA GPUs (torch's SyncBatchNorm is GPU-only): "
                              "set trainer.sync_batchnorm=false on CPU")

    def setup_distributed(self) -> None:
        backend = self.requested_backend or ("nccl" if self.root_device.type == "cuda" else "gloo")
        self.set_world_ranks()
        if not init_group_of_this_attempt(backend, self.collective_timeout, self.root_device) and self.num_nodes == 1:
            store = init_group_with_local_store(backend, self.collective_timeout, self.root_device,
                                                self.global_rank, self.world_size)
            if store is not None:  # Lightning's own line, which its skipped initialisation would have printed
                log.info(f"Initializing distributed: GLOBAL_RANK: {self.global_rank}, MEMBER: {self.global_rank + 1}/"
                         f"{self.world_size} (one node: file rendezvous, gloo on loopback)", rank=None)
            self.file_store = store or self.file_store  # kept for later fit/test calls of this process
        super().setup_distributed()  # Lightning keeps a group that is already up
        destroy_default_group_at_exit()
        if self.hang_timeout_s and self.world_size > 1 and self.watchdog is None:
            self.watchdog = RankWatchdog(self.global_rank, self.world_size, timeout_s=self.hang_timeout_s,
                                         store=self.file_store)
            self.watchdog.start()

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        install_sigterm_agreement(trainer, self.sigterm_check_every_n_batches)

    def on_exception(self, exception: BaseException) -> None:
        """A failed collective because a peer died or froze: name that rank and end this one (watchdog)."""
        if self.watchdog is not None:
            if isinstance(exception, SystemExit | KeyboardInterrupt) or user_error_cause(exception) is not None:
                self.watchdog.finish(reported=True)  # this rank reports its own error: peers stop quietly
            else:
                self.watchdog.end_if_a_peer_failed()
        super().on_exception(exception)

    def teardown(self) -> None:
        if self.watchdog is not None:
            self.watchdog.finish()  # peers no longer count this rank as failed when it exits
            self.watchdog = None
        super().teardown()

    def __getstate__(self) -> dict[str, Any]:
        # ddp_spawn pickles the strategy: the watchdog thread and the store stay in the process that made them
        return {**self.__dict__, "watchdog": None, "file_store": None}
