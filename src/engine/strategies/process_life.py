"""``ProcessLife``: what every multi-process strategy of the project adds to Lightning's, in one mixin.

Lightning's DDP and its ModelParallel (FSDP2) strategies start and end their process groups in
different hooks, so the pieces are methods each strategy calls from the hook that fits it:

* :meth:`ProcessLife.join_process_group`, before Lightning starts the group: a torchrun restart joins
  a store namespace of its own (:mod:`src.engine.runtime.elastic_restart`), a one-node run rendezvous through
  a file with gloo on loopback (:mod:`src.engine.runtime.local_store`); Lightning keeps a group already up;
* :meth:`ProcessLife.watch_process_group`, once the group is up: it is destroyed before the interpreter
  exits (:mod:`src.engine.runtime.exit_cleanup`), and a dead, frozen or stuck rank ends every rank (:mod:`src.engine.runtime.watchdog`);
* ``on_exception``, ``teardown`` and pickling (``ddp_spawn``) come with the mixin.

The SIGTERM agreement (:mod:`src.engine.runtime.sigterm`) is installed by each strategy's ``setup``.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch.distributed import Store

from src.engine.runtime.elastic_restart import init_group_of_this_attempt
from src.engine.runtime.exit_cleanup import destroy_default_group_at_exit
from src.engine.runtime.flight_recorder import record_collectives
from src.engine.runtime.launch_context import TORCHRUN, launch_context
from src.engine.runtime.local_store import init_group_with_local_store
from src.engine.runtime.sigterm import check_interval
from src.engine.runtime.watchdog import RankWatchdog
from src.engine.utils import lightning_compat as compat
from src.engine.utils.errors import ConfigError, user_error_cause
from src.engine.utils.pylogger import RankedLogger

log = RankedLogger(__name__)

COLLECTIVE_TIMEOUT = timedelta(minutes=10)  # torch's default, 30 min, leaves a hung job idle for half an hour


def collective_timeout(timeout: timedelta | float | None) -> timedelta:
    """How long a collective waits for a busy peer: ``timedelta`` or seconds; ``None``: 10 minutes."""
    if timeout is None:
        return COLLECTIVE_TIMEOUT
    return timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)


def positive_seconds(key: str, value: float | None, null_means: str) -> float | None:
    """``value`` if it is a positive number of seconds or None; otherwise one line naming
    ``trainer.strategy.<key>`` (``null_means``: what None does)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or value <= 0):
        raise ConfigError(f"trainer.strategy.{key}={value!r} is not a positive number of seconds; fix: set one, "
                          f"or null {null_means}")
    return value


class ProcessLife:
    """Strategy mixin (list it before Lightning's strategy class); call :meth:`init_process_life` in ``__init__``."""

    def follow_torchrun_nodes(self) -> None:
        """Take ``num_nodes`` from the world torchrun started. With ``--nnodes=MIN:MAX`` it restarts the workers
        at whatever number of nodes is left (or has joined), and Lightning refuses a ``devices x num_nodes`` that
        is not the world size: the node count follows torchrun's, said once in one line. The run then resumes
        from its ``last.ckpt`` with the same global batch."""
        ctx = launch_context()
        if (ctx.launcher != TORCHRUN or not ctx.world_size or ctx.local_world_size != self.num_processes
                or ctx.world_size % self.num_processes):
            return
        nodes = ctx.world_size // self.num_processes
        if nodes != self.num_nodes:
            log.warning(f"torchrun started {nodes} node(s) of {self.num_processes} process(es), not "
                        f"trainer.num_nodes={self.num_nodes} (an elastic --nnodes=MIN:MAX launch): training on "
                        f"{nodes * self.num_processes} rank(s), same global batch")  # rank 0 only (RankedLogger)
            self.num_nodes = nodes

    def init_process_life(self, sigterm_check_every_n_batches: int, hang_timeout_s: float | None,
                          timeout: timedelta, backend: str | None) -> None:
        """Check and keep the options every multi-process strategy of the project takes."""
        self.sigterm_check_every_n_batches = check_interval(sigterm_check_every_n_batches)
        self.hang_timeout_s = positive_seconds("hang_timeout_s", hang_timeout_s, "to turn the watchdog off")
        self.collective_timeout = timeout
        self.requested_backend = backend
        self.watchdog: RankWatchdog | None = None
        self.file_store: Store | None = None  # the one-node rendezvous (src/engine/runtime/local_store.py)

    @property
    def group_backend(self) -> str:
        """The process-group backend: the one asked for, else nccl on CUDA and gloo elsewhere."""
        return self.requested_backend or ("nccl" if self.root_device.type == "cuda" else "gloo")

    def join_process_group(self) -> None:
        """Before Lightning starts the group: this torchrun attempt's namespace, or a one-node file rendezvous."""
        if self.hang_timeout_s:  # before the group exists: torch reads these when it makes the group
            record_collectives(self.group_backend, self.flight_recorder_dir)
        self.set_world_ranks()
        device: torch.device = self.root_device
        if init_group_of_this_attempt(self.group_backend, self.collective_timeout, device) or self.num_nodes != 1:
            return
        store = init_group_with_local_store(self.group_backend, self.collective_timeout, device, self.global_rank,
                                            self.world_size)
        if store is not None:  # Lightning's own line, which its skipped initialisation would have printed
            log.info(f"Initializing distributed: GLOBAL_RANK: {self.global_rank}, MEMBER: {self.global_rank + 1}/"
                     f"{self.world_size} (one node: file rendezvous, gloo on loopback)", rank=None)
        self.file_store = store or self.file_store  # kept for later fit/test calls of this process

    def watch_process_group(self) -> None:
        """Once the group is up: destroy it at exit, and start the dead/frozen-rank watchdog."""
        destroy_default_group_at_exit()
        if self.hang_timeout_s and self.world_size > 1 and self.watchdog is None:
            self.watchdog = RankWatchdog(self.global_rank, self.world_size, timeout_s=self.hang_timeout_s,
                                         store=self.file_store, progress=self.progress,
                                         flight_recorder_dir=self.flight_recorder_dir)
            self.watchdog.start()

    @property
    def flight_recorder_dir(self) -> Path:
        """Where each rank's record of its collectives goes when a rank is stuck: ``<run dir>/flight_recorder``."""
        try:
            root = self.lightning_module.trainer.default_root_dir
        except (AttributeError, RuntimeError):  # no module or trainer attached
            root = "."
        return Path(root) / "flight_recorder"

    def progress(self) -> tuple[int, int, int]:
        """What the watchdog publishes: batches this rank finished (every loop), collectives it entered, global step.

        Read from the watchdog's thread while the main thread may be stuck: plain counters only.
        """
        try:
            trainer = self.lightning_module.trainer
            loops = (trainer.fit_loop.epoch_loop, trainer.fit_loop.epoch_loop.val_loop, trainer.validate_loop,
                     trainer.test_loop, trainer.predict_loop)
            batches = sum(loop.batch_progress.total.processed for loop in loops)
            return batches, compat.collectives_entered(), trainer.global_step
        except (AttributeError, RuntimeError):  # no trainer attached yet
            return 0, 0, 0

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
