"""``ps``: asynchronous parameter-server training for Lightning 2.x (``trainer=ps``).

Neither Lightning nor torch ships one (torch's RPC parameter-server tutorial is a pattern, not a library,
on a backend now in maintenance mode), so the transport and the update rules are the project's own
(:mod:`.link`, :mod:`.server`); everything else is Lightning's loop, as the pipeline strategy keeps it.

* **Roles** (:mod:`.layout`): the first ``num_servers`` ranks are servers, the others workers. A server
  holds a share of the parameters (whole tensors, balanced by size) and steps its own copy of the
  module's optimizer over them. Rank 0, the *chief*, is a server that also evaluates, logs and writes
  checkpoints.
* **Workers** run Lightning's training loop on their own data shard (``distributed_sampler_kwargs``:
  one replica per worker). Their optimizer is :class:`~.client.PushPullOptimizer`: ``step`` pushes the
  gradients to the servers and pulls fresh parameters. A worker stops when a server answers DONE.
* **Servers** run Lightning's loop as a clock: each of their training steps waits until one global
  batch's worth of updates is applied (W pushes, or one synchronous round), so ``global_step``, epochs,
  ``max_steps``, schedulers, validation and checkpoint intervals mean what they mean under DDP.
* **Evaluation** runs on the chief alone, over the whole set, on the servers' parameters gathered into
  its module: the metrics are the single-device values, exactly. The other ranks' evaluation loaders
  are empty. Checkpoints hold the full, unsplit model and one standard optimizer state dict.
* **No process group spans the job**: a worker may leave at any moment, so every Lightning collective
  (barrier, broadcast, reduce) is local, and the few facts every rank must share go through the
  rendezvous store (:mod:`.coordination`). A worker that dies or freezes leaves and the others carry on
  until the planned number of updates is applied; a restarted worker joins again. A server that fails
  ends the job with one line naming it; the same command then resumes from ``last.ckpt``.
* **Stop signals**: a worker that gets SIGTERM leaves (exit 128 + signal); a server that gets one asks
  the chief, which saves ``last.ckpt`` at its next step, and every rank exits 128 + signal.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.callbacks import Checkpoint, EarlyStopping
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor
from torch.optim.lr_scheduler import ReduceLROnPlateau
from torch.utils.data import DataLoader

from src.engine.callbacks.monitored_metric import MonitoredMetricCheck
from src.engine.checkpointing.io import AtomicCheckpointIODefault
from src.engine.runtime.exit_cleanup import destroy_default_group_at_exit, release_before_destroy
from src.engine.runtime.loader_workers import WorkersOutliveStopSignals
from src.engine.runtime.local_store import local_store_path
from src.engine.runtime.sigterm import Preempted, SigtermSync, install_stop_handlers, stop_for_preemption
from src.engine.strategies.launchers import PSSubprocessLauncher
from src.engine.strategies.options import refuse_foreign_options
from src.engine.strategies.process_life import ProcessLife, collective_timeout, positive_seconds
from src.engine.strategies.ps.client import PushPullOptimizer, ServerClient, ServerLost, read_server
from src.engine.strategies.ps.coordination import EndWatch, JobStore, end_job_after_failure, stopped_by
from src.engine.strategies.ps.layout import CHIEF, Roles, shard_by_size
from src.engine.strategies.ps.serve import ServerLinks, why_it_left
from src.engine.strategies.ps.server import ParameterServer, shaped_views
from src.engine.utils import lightning_compat as compat
from src.engine.utils.errors import ConfigError
from src.engine.utils.pylogger import RankedLogger

log = RankedLogger(__name__)

POLL_S = 0.25
SERVER_DEVICES = ("auto", "cpu")


class ParameterServerStrategy(WorkersOutliveStopSignals, compat.BuildsLauncher, AtomicCheckpointIODefault, ProcessLife, ParallelStrategy):
    """Parameter servers and asynchronous workers over ``trainer.devices x num_nodes`` processes.

    Built on Lightning's ``ParallelStrategy`` with what it shares with ddp (the launcher with its pre-flight,
    the process life, atomic checkpoints), not on DDP: no process group spans the job.

    Args:
        num_servers: ranks ``0 .. num_servers-1`` serve; the others are workers.
        max_staleness: how many steps a worker may run ahead of the slowest live worker before it waits
            (stale synchronous parallel); ``0`` is bulk synchronous training, ``None`` no bound (no worker
            ever waits for another).
        server_device: ``auto`` (a server uses its process's device) or ``cpu``: on GPUs, one worker per
            GPU and ``num_servers`` more processes on the CPU of the same machine (TensorFlow's
            CentralStorageStrategy when synchronous).
        link_timeout_s: a link that gets no answer this long fails: a frozen worker leaves, a frozen server
            ends the job, and servers left with no worker this long end it too (``None``: the collective
            ``timeout``, 10 minutes by default). It must exceed the longest wait for a round. (ps runs no
            heartbeat watchdog, so ddp's ``hang_timeout_s`` is refused here.)
        timeout: how long a rank waits at the rendezvous store (``timedelta`` or seconds; ``None``: 10 min).
        start_method, process_group_backend: accepted for the configs' sake; only ``popen`` and gloo links run.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin: as Lightning's.
    """

    strategy_name = "ps"
    names_every_option = True  # src/engine/strategies/options.py
    runs_owned_step = False  # its optimizer step pushes gradients to the servers
    random_state_per_rank = False  # updates depend on when pushes arrive: a resumed run cannot replay bit-exact
    outlives_a_failed_rank = True  # a worker's failure does not end the job (src/engine/run/status.py)

    def __init__(self, num_servers: int = 1, max_staleness: int | None = None, server_device: str = "auto",
                 link_timeout_s: float | None = 120.0, timeout: dt.timedelta | float | None = None, start_method: str = "popen",
                 process_group_backend: str | None = None, accelerator: pl.accelerators.Accelerator | None = None,
                 parallel_devices: list[torch.device] | None = None, cluster_environment: Any | None = None,
                 checkpoint_io: Any | None = None, precision_plugin: pl.plugins.Precision | None = None,
                 **unknown: Any) -> None:
        if "hang_timeout_s" in unknown:
            raise ConfigError("trainer.strategy.hang_timeout_s times the heartbeat watchdog of ddp, fsdp and pipeline; "
                              "trainer=ps has none: a silent link is timed by trainer.strategy.link_timeout_s; fix: "
                              "set that instead")
        refuse_foreign_options(type(self), unknown)
        if isinstance(num_servers, bool) or not isinstance(num_servers, int) or num_servers < 1:
            raise ConfigError(f"trainer.strategy.num_servers={num_servers!r} is not an integer >= 1; fix: set one")
        if max_staleness is not None and (isinstance(max_staleness, bool) or not isinstance(max_staleness, int)
                                          or max_staleness < 0):
            raise ConfigError(f"trainer.strategy.max_staleness={max_staleness!r} must be an integer >= 0 (0: "
                              "synchronous), or null for no bound; fix: set one of those")
        if server_device not in SERVER_DEVICES:
            raise ConfigError(f"trainer.strategy.server_device={server_device!r} is unknown; fix: use one of "
                              f"{', '.join(SERVER_DEVICES)}")
        if start_method != "popen":
            raise ConfigError(f"trainer.strategy.start_method={start_method!r}: trainer=ps starts its ranks with "
                              "popen only (a worker must be able to start again on its own); fix: leave start_method unset")
        if process_group_backend not in (None, "gloo"):
            raise ConfigError(f"trainer.strategy.process_group_backend={process_group_backend!r}: trainer=ps "
                              "sends through gloo links; fix: leave it null")
        self.num_servers, self.max_staleness, self.server_device = num_servers, max_staleness, server_device
        self.link_timeout_s = positive_seconds("link_timeout_s", link_timeout_s, "for the collective timeout")
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self._num_nodes = 1
        compat.accept_sync_batchnorm(self)  # so that sync_batchnorm=true reaches the pre-flight, which refuses it
        # a stop note acts at the next batch (no collective to agree on); no heartbeat watchdog: links time out
        self.init_process_life(1, None, collective_timeout(timeout), process_group_backend)
        self.jobs: JobStore | None = None
        self.server: ParameterServer | None = None
        self.links: ServerLinks | None = None
        self._end_watch: EndWatch | None = None
        self.client: ServerClient | None = None
        self._stop: SigtermSync | None = None
        self._shards: list[list[torch.nn.Parameter]] = []
        self._met = False
        self._batch_size = 0
        self._pending_optimizer_state: dict[str, Any] | None = None

    # -- who is who -------------------------------------------------------------------------------
    @property
    def parallel_devices(self) -> list[torch.device] | None:
        return self._ps_devices

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        """``server_device=cpu`` on GPUs: the servers are CPU processes in front of one worker per GPU."""
        if devices and getattr(self, "server_device", "auto") == "cpu" and devices[0].type != "cpu":
            devices = [torch.device("cpu")] * self.num_servers + list(devices)
        self._ps_devices = devices

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes  # set by the Trainer from trainer.num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def root_device(self) -> torch.device:
        return self.parallel_devices[self.local_rank]

    def set_world_ranks(self) -> None:
        """This rank's place from the launcher's environment, as Lightning's DDP sets it."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = fabric_rank_zero_only.rank = self.global_rank

    def model_to_device(self) -> None:
        self.model.to(self.root_device)

    @property
    def roles(self) -> Roles:
        return Roles(self.num_nodes * self.num_processes, self.num_servers)

    @property
    def is_server(self) -> bool:
        return self.roles.is_server(self.global_rank)

    @property
    def is_chief(self) -> bool:
        return self.global_rank == CHIEF

    def _trainer(self) -> pl.Trainer | None:
        """The Trainer this strategy runs in, or None before one is attached (the pre-flight)."""
        try:
            return self.lightning_module.trainer if self.lightning_module is not None else None
        except RuntimeError:  # Lightning: the module is not attached to a Trainer yet
            return None

    @property
    def link_timeout(self) -> dt.timedelta:
        return dt.timedelta(seconds=self.link_timeout_s) if self.link_timeout_s else self.collective_timeout

    @property
    def _cpu_server_beside_gpus(self) -> bool:
        return self.is_server and self.root_device.type == "cpu" and self.accelerator is not None and \
            not isinstance(self.accelerator, pl.accelerators.CPUAccelerator)

    @property
    def _updates_per_step(self) -> int:
        """Server updates in one global batch: one synchronous round, or one push from each planned worker."""
        return 1 if self.max_staleness == 0 else self.roles.num_workers

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Training data is split over the workers (a server's loop only counts steps); evaluation runs whole
        on the chief (the others get empty loaders: :meth:`process_dataloader`)."""
        trainer = self._trainer()
        stage = trainer.state.stage if trainer is not None else None
        if stage is not None and (stage.evaluating or stage == RunningStage.PREDICTING):
            return {"num_replicas": 1, "rank": 0}
        roles = self.roles
        rank = 0 if roles.is_server(self.global_rank) else roles.worker_index(self.global_rank)
        return {"num_replicas": max(roles.num_workers, 1), "rank": rank}

    # -- checks before any rank starts --------------------------------------------------------------
    def check_before_launch(self, trainer: pl.Trainer, model: pl.LightningModule,
                            datamodule: pl.LightningDataModule | None = None) -> None:
        """What ps checks before any rank starts (:func:`src.engine.strategies.launchers.preflight`)."""
        world = self.num_nodes * self.num_processes
        if self.num_servers >= world:
            raise ConfigError(f"trainer.strategy.num_servers={self.num_servers} leaves no worker among the {world} "
                              f"processes (trainer.devices x trainer.num_nodes); fix: raise trainer.devices or lower "
                              "num_servers")
        if trainer.state.fn == TrainerFn.PREDICTING:
            raise ConfigError("trainer=ps does not predict; fix: load the checkpoint on one device (trainer=default)")
        if not model.automatic_optimization:
            raise ConfigError("trainer=ps pushes the gradients of Lightning's optimizer step: manual optimization "
                              "is not supported; fix: use automatic optimization (model.owned_step=false)")
        if trainer.accumulate_grad_batches != 1:
            raise ConfigError(f"trainer.accumulate_grad_batches={trainer.accumulate_grad_batches}: under trainer=ps "
                              "every batch is one push; fix: raise data.batch_size instead")
        if getattr(self.precision_plugin, "scaler", None) is not None:
            raise ConfigError("trainer.precision=16-mixed scales the loss per worker, which the servers cannot "
                              "undo; fix: use bf16-mixed or 32-true")
        if compat.layer_sync_of(self) is not None:
            raise ConfigError("trainer.sync_batchnorm=true needs a process group over the workers, which ps has "
                              "not got; fix: set it to false")
        if self.server_device == "cpu" and self.num_nodes > 1 and self.parallel_devices[-1].type != "cpu":
            raise ConfigError("trainer.strategy.server_device=cpu is the one-machine form (servers on the CPU beside "
                              "the GPUs); fix: set trainer.num_nodes=1, or server_device=auto")

    def build_launcher(self) -> PSSubprocessLauncher:
        return PSSubprocessLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    # -- start-up: the store instead of a process group -------------------------------------------
    def setup_environment(self) -> None:
        if not self._cpu_server_beside_gpus:
            self.accelerator.setup_device(self.root_device)
        self.setup_distributed()

    def setup_distributed(self) -> None:
        reset_seed()
        self.set_world_ranks()
        if self.jobs is None:
            self.jobs = JobStore(self._rendezvous_store(), self.collective_timeout)
            self.jobs.publish_self(self.global_rank)
            release_before_destroy(self._release)
            destroy_default_group_at_exit()

    def _rendezvous_store(self) -> dist.Store:
        """The store the ranks meet on: the launcher's file on one node, else torch's TCP store at the main
        address (hosted by rank 0, or joined in torchrun's agent)."""
        path = local_store_path()
        if path and self.num_nodes == 1:
            store = dist.FileStore(path, -1)  # -1: workers come and go, so no count of users may delete it
            store.set_timeout(self.collective_timeout)
            return store
        address = f"tcp://{self.cluster_environment.main_address}:{self.cluster_environment.main_port}"
        store, _, _ = next(dist.rendezvous(address, self.global_rank, self.world_size, timeout=self.collective_timeout))
        return store

    def barrier(self, name: str | None = None, *args: Any, **kwargs: Any) -> None:
        """Only the ranks' first meeting waits for every rank (Lightning's ``pre_setup``, after each node's first
        rank prepared the data); afterwards no barrier spans the job: a worker may have left."""
        if name == "pre_setup" and not self._met and self.jobs is not None:
            self.jobs.meet(self.world_size)
            self._met = True

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj  # each rank decides for itself; only the chief writes

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        return tensor

    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        return tensor.unsqueeze(0)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return decision

    # -- set-up per role ----------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer) -> None:
        """Not DDP's set-up: nothing is wrapped and nothing is broadcast (the workers pull from the servers)."""
        if not self._cpu_server_beside_gpus:
            self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if not fitting:
            return
        compat.optimizers_to_device(self.optimizers, self.root_device)
        if len(self.optimizers) != 1:
            raise ConfigError(f"trainer=ps steps one optimizer on the servers; configure_optimizers returned "
                              f"{len(self.optimizers)}; fix: return one optimizer")
        self._leave_decisions_to_the_chief(trainer)
        module, roles = self.lightning_module, self.roles
        params = [p for p in module.parameters() if p.requires_grad]
        owner = shard_by_size([p.numel() for p in params], self.num_servers)
        self._shards = [[p for p, o in zip(params, owner, strict=True) if o == s] for s in range(self.num_servers)]
        buffers = list(module.buffers())
        if self.is_server:
            if self.num_servers > 1 and any(isinstance(c.scheduler, ReduceLROnPlateau) for c in self.lr_scheduler_configs):
                raise ConfigError("ReduceLROnPlateau follows the chief's validation, which the other servers do not "
                                  "see; fix: use one server or another scheduler")
            self.server = ParameterServer(self._shards[self.global_rank], self.optimizers[0],
                                          buffers if self.is_chief else [], roles.num_workers, self.max_staleness,
                                          self.root_device, log=self._log_member)
            self.links = ServerLinks(self.server, self.jobs, self.global_rank, self.link_timeout, self.collective_timeout)
            self.links.start()
        else:
            self.client = ServerClient(self.jobs, roles.worker_index(self.global_rank), self._shards, buffers,
                                       self.link_timeout, self.collective_timeout)
            self._end_watch = EndWatch(self.jobs, self.global_rank, self.link_timeout.total_seconds())
            self.optimizers = [PushPullOptimizer(self.optimizers[0], self.client, lambda: self._batch_size)]
            self.lr_scheduler_configs = []  # the servers keep the schedule
        self._stop = install_stop_handlers(trainer, self.sigterm_check_every_n_batches, self._on_stop_signal)

    def _leave_decisions_to_the_chief(self, trainer: pl.Trainer) -> None:
        """Only the chief validates, checkpoints and stops early; a worker trains until a server says DONE."""
        if self.is_chief:
            return
        chief_only = Checkpoint | EarlyStopping | MonitoredMetricCheck
        trainer.callbacks = [c for c in trainer.callbacks if not isinstance(c, chief_only)]
        trainer.fit_loop.min_epochs, trainer.fit_loop.epoch_loop.min_steps = 0, None
        if not self.is_server:
            trainer.fit_loop.max_epochs, trainer.fit_loop.epoch_loop.max_steps = -1, -1

    def _log_member(self, worker: int, what: str) -> None:
        rank = self.roles.worker_rank(worker)
        line = f"ps: worker {worker}, {self.jobs.describe(rank)}, {what}"
        (log.warning if what.startswith("left") and "finished" not in what else log.info)(line)

    def on_train_start(self) -> None:
        trainer = self.lightning_module.trainer
        if self.server is not None:
            planned = trainer.estimated_stepping_batches
            u = self._updates_per_step
            self.server.open(trainer.global_step * u, None if planned == float("inf") else int(planned) * u)
        elif self.client is not None:
            try:
                self.client.join()
            except ServerLost as lost:
                self._server_failed(lost)
                self._worker_ends()  # started after the job ended

    # -- steps --------------------------------------------------------------------------------------
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._check_stop_signals()
        if self.server is None:
            if self.client is not None:
                self._batch_size = extract_batch_size(args[0])
            return super().training_step(*args, **kwargs)
        return self._server_step()

    def _check_stop_signals(self) -> None:
        """Before each batch's work, on every rank: Lightning runs its per-batch stop check only under a process
        group, which ps has not got. No rank waits for another to agree, so a noted signal acts at once (a
        server's clock must not count steps it skipped). The chief also takes up a stop a server asked for."""
        if self.is_chief:
            self._stop.signum = max(self._stop.signum, self.links.stop_signal)
        if self._stop.signum:
            self._on_stop_signal(self.lightning_module.trainer, self._stop.signum)

    def _server_step(self) -> Tensor:
        """One step of a server's clock: wait for one global batch's worth of updates, log what they were."""
        trainer, module = self.lightning_module.trainer, self.lightning_module
        target = (trainer.global_step + 1) * self._updates_per_step
        while not self.server.wait_applied(target, POLL_S) and not self.server.done:
            if self._leave_step_early(trainer):
                break
        progress = self.server.take_progress()
        loss = progress["loss_sum"] / progress["samples"] if progress["samples"] else 0.0
        if progress["samples"]:
            module.log("train/loss", loss, on_step=False, on_epoch=True, prog_bar=True,
                       batch_size=int(progress["samples"]))
            module.log("ps/staleness", progress["staleness"], on_step=False, on_epoch=True)
        module.log("ps/workers", float(progress["live"]), on_step=False, on_epoch=True)
        return torch.tensor(loss, device=self.root_device)

    def _leave_step_early(self, trainer: pl.Trainer) -> bool:
        """While a server waits for pushes: end on a failure, stop on a signal, finish with the chief."""
        links, server = self.links, self.server
        if links.failed or links.store_lost:
            end_job_after_failure(None, self.global_rank, "", fallback_reporter=False)
        if server.empty_since is not None and time.monotonic() - server.empty_since > self.link_timeout.total_seconds():
            end_job_after_failure(self.jobs, self.global_rank, f"every worker left and none joined again within "
                                  f"{self.link_timeout.total_seconds():g} s", fallback_reporter=True)
        signum = max(self._stop.signum, links.stop_signal if self.is_chief else 0)
        if signum:
            self._stop.signum = signum  # the stop check before the next batch stops this rank
            return True
        if links.done is not None:
            trainer.should_stop = True
            return True
        return False

    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        if self.server is not None:
            return closure_loss  # a server's step computes nothing: its updates come from the pushes
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        if self.server is not None:
            return closure()  # the clock step; the link threads apply the updates
        try:
            out = super().optimizer_step(optimizer, closure, model, **kwargs)
        except ServerLost as lost:
            self._server_failed(lost)  # returns only when the job had ended: the servers are gone on purpose
            out = None
        if self.client is not None and self.client.done:
            self._worker_ends()
        return out

    def _worker_ends(self) -> None:
        """A server answered DONE, or the job had ended: stop as the job did (a stop signal: exit 128 + it)."""
        trainer = self.lightning_module.trainer
        self.client.done = trainer.should_stop = True
        signum = stopped_by(self.jobs.ended())
        if signum:
            self.client.leave(signum)
            compat.mark_sigterm_received(trainer)
            raise Preempted(signum)

    def _server_failed(self, lost: ServerLost) -> None:
        """A worker lost a server's link: if the job had ended, end with it; otherwise the server died (one line,
        exit)."""
        if self.jobs.ended() is not None:
            self.client.done = True
            return
        what = why_it_left(lost.__cause__ or lost, self.link_timeout).removeprefix("left: ")
        what = "died" if "gone" in what else what.replace("it stopped", "stopped")
        first_worker = self.roles.worker_index(self.global_rank) == 0
        end_job_after_failure(self.jobs, self.global_rank, f"server {self.jobs.describe(lost.server)} {what}",
                              fallback_reporter=first_worker)

    # -- stop signals -------------------------------------------------------------------------------
    def _on_stop_signal(self, trainer: pl.Trainer, signum: int) -> None:
        """A stop signal noted on this rank, or on the chief asked for by a server (see the module docstring)."""
        if self.is_chief:
            stop_for_preemption(trainer, signum)  # saves last.ckpt, raises; on_exception tells the others
        if self.is_server:
            self.jobs.request_stop(signum)
            while self.links.done is None and not (self.links.failed or self.links.store_lost):
                time.sleep(POLL_S)  # keep serving: the chief reads this server's share for last.ckpt
        elif self.client is not None:
            self.client.leave(signum)
        compat.mark_sigterm_received(trainer)
        raise Preempted(signum)

    # -- evaluation and checkpoints: the servers' parameters, gathered on the chief -----------------
    def on_validation_start(self) -> None:
        if self.server is not None and self.is_chief:
            self._gather(with_state=False)

    def _gather(self, with_state: bool) -> dict[str, Any] | None:
        """Copy every server's parameters into the chief's module; with ``with_state``, the merged optimizer state."""
        with self.server.cond:  # this server's parameters and optimizer state of one moment
            self.server.write_back()
            states = [self.server.optimizer_state()] if with_state else []
        for s in range(1, self.num_servers):
            try:
                flat, state = read_server(self.jobs, s, self._shards[s], self.link_timeout, with_state)
            except ServerLost as lost:
                end_job_after_failure(self.jobs, self.global_rank, f"server {self.jobs.describe(lost.server)} died",
                                      fallback_reporter=True)
            with torch.no_grad():
                for p, value in zip(self._shards[s], shaped_views(flat, self._shards[s]), strict=True):
                    p.copy_(value)
            states.append(state)
        if not with_state:
            return None
        merged = {"state": {}, "param_groups": states[0]["param_groups"]}
        for state in states:
            merged["state"].update(state["state"])  # whole-model indices; each server holds its own
        return merged

    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self.server is not None and self.is_chief:
            self._pending_optimizer_state = self._gather(with_state=True)  # read next by optimizer_state
        return super().lightning_module_state_dict()

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if self._pending_optimizer_state is not None:
            state, self._pending_optimizer_state = self._pending_optimizer_state, None
            return state
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        if isinstance(optimizer, PushPullOptimizer):
            return {}  # a worker's optimizer holds nothing: the servers do
        return super().optimizer_state(optimizer)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if self.client is not None:
            return  # the servers restore it
        if self.server is None:
            super().load_optimizer_state_dict(checkpoint)
            return
        (state,) = checkpoint["optimizer_states"]
        self.server.load_optimizer_state(state)
        for group, saved in zip(self.optimizers[0].param_groups, state["param_groups"], strict=True):
            group.update({k: v for k, v in saved.items() if k not in ("params", "param_names")})

    def process_dataloader(self, dataloader: Any) -> Any:
        trainer = self.lightning_module.trainer
        stage = trainer.state.stage
        if not self.is_chief and stage is not None and (stage.evaluating or stage == RunningStage.PREDICTING):
            return DataLoader([])  # the chief evaluates every sample
        return super().process_dataloader(dataloader)  # its workers outlive the stop signals

    # -- the end ------------------------------------------------------------------------------------
    def on_train_end(self) -> None:
        if self.server is not None:
            if self.is_chief:
                self.jobs.finish("finished")
            else:  # keep serving until the chief has read this server's share for its last checkpoint
                while self.links.done is None and not (self.links.failed or self.links.store_lost):
                    time.sleep(POLL_S)
            self.server.close(wait_for_workers_s=self.link_timeout.total_seconds())
        elif self.client is not None:
            self.client.leave()

    def on_exception(self, exception: BaseException) -> None:
        stopped = isinstance(exception, Preempted)
        if self.is_chief and self.jobs is not None:
            self.jobs.finish(f"stopped {exception.code - 128}" if stopped else "failed")
        if stopped and self.server is not None:  # the workers learn of the stop at their next push, and leave
            self.server.close(wait_for_workers_s=self.link_timeout.total_seconds())
        self._release()
        super().on_exception(exception)

    def teardown(self) -> None:
        self._release()
        super().teardown()

    def _release(self) -> None:
        """Close this rank's links and threads (a worker says goodbye); the job's store stays for later calls."""
        if self.client is not None:
            self.client.leave()
        if self.server is not None:
            self.server.close()
        if self.links is not None:
            self.links.stop()
        if self._end_watch is not None:
            self._end_watch.stop()
        self.server = self.links = self.client = self._end_watch = None

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "jobs": None, "server": None, "links": None, "client": None,
                "_end_watch": None}

