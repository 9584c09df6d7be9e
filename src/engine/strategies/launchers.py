"""How the project's multi-process strategies start their ranks: Lightning's launchers, plus the pre-flight.

:class:`PreflightSubprocessLauncher` (``start_method="popen"``) and :class:`PreflightMultiprocessingLauncher`
(``spawn``) are Lightning's own launchers with two additions. ``DDPStrategy.build_launcher`` builds them
where Lightning builds its own (``compat.BuildsLauncher``):

* before any rank starts, :func:`preflight` checks the strategy against the model and the data, the
  global-batch rule and the rendezvous, so ``Trainer(strategy=DDPStrategy())`` gets the same one-line
  errors as ``src/train.py``;
* under Hydra, a child rank re-runs *this job* (:func:`child_command`), not the parent's ``sys.argv``. In a
  multirun that argv is the whole sweep (``-m lr=0.01,0.1``): each child would replay every job in
  directories of its own. The child command replays this job's config name, resolved overrides and output
  directory, so every rank of a job logs into the same run dir and only the parent writes ``.hydra/``.

A one-node run also gets a file rendezvous on loopback (:mod:`src.engine.runtime.local_store`).
"""

from __future__ import annotations

import contextlib
import logging.config
import os
import subprocess
import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import nn
from torch.multiprocessing import ProcessExitedException

from src.engine.checkpointing.last_checkpoint import trainer_position
from src.engine.run.identity import shared_with_forked_ranks
from src.engine.runtime import early_ranks, prompt_exit
from src.engine.runtime.child_guard import guard_child_ranks
from src.engine.runtime.exit_cleanup import exit_after_peer_failure, peer_failed
from src.engine.runtime.hydra_launch import entry_command
from src.engine.runtime.local_store import STORE_ENV, prepare_local_store
from src.engine.runtime.rendezvous import check_rendezvous
from src.engine.runtime.sigterm import (
    hold_stop_signals,
    passed_on_to_spawned_ranks,
    stop_exit_code,
    stop_of_spawned_ranks,
)
from src.engine.strategies.global_batch import per_replica_batch_size
from src.engine.utils import lightning_compat as compat
from src.engine.utils.hooks import ChecksBeforeLaunch, FetchesData, GlobalBatch
from src.engine.utils.pylogger import RankedLogger, current_rank

log = RankedLogger(__name__)

# -- the pre-flight: once per trainer and model, before any rank starts ------------------------------------
_checked: weakref.WeakKeyDictionary[L.Trainer, tuple[int, int]] = weakref.WeakKeyDictionary()


def preflight(trainer: L.Trainer, model: L.LightningModule, datamodule: L.LightningDataModule | None = None) -> None:
    """The checks that need the built Trainer, model and data, before any rank starts; root causes first.

    The strategy checks itself against the model (``check_before_launch``: model structure first, then its
    settings), a DataModule that fetches its files does so, the project's DataModules check the
    global-batch rule, and a multi-process run checks its rendezvous. Runs once per trainer, model and data:
    ``src/train.py`` calls it before it records the run as running, and the launchers above call it for a
    Trainer built without ``src/train.py``.
    """
    key = (id(model), id(datamodule))
    if _checked.get(trainer) == key:
        return
    strategy = trainer.strategy
    if isinstance(strategy, ChecksBeforeLaunch):
        strategy.check_before_launch(trainer, model, datamodule)
    if isinstance(datamodule, FetchesData) and datamodule.fetches_data_in_prepare and _prepares_data(trainer, datamodule):
        datamodule.prepare_data()  # where Lightning would run it in the fit: found, or one line now
    if isinstance(datamodule, GlobalBatch) and datamodule.batch_size_is_global:  # others keep their meaning
        per_replica_batch_size(datamodule.hparams.batch_size, strategy)
    if trainer.world_size > 1 or trainer.num_nodes > 1:
        check_rendezvous(trainer.num_nodes)
    _checked[trainer] = key


def _prepares_data(trainer: L.Trainer, datamodule: L.LightningDataModule) -> bool:
    """This process is the one Lightning has prepare the data: local rank 0, or global rank 0 when the data is
    prepared once for every node (``prepare_data_per_node=False``)."""
    return (trainer.local_rank if datamodule.prepare_data_per_node else trainer.global_rank) == 0


def _preflight_launch(trainer: L.Trainer | None, args: tuple, fresh_store: bool,
                      ranks: Sequence[subprocess.Popen] = ()) -> None:
    if trainer is None:
        return
    if trainer.lightning_module is not None:
        datamodule = next((a for a in args if isinstance(a, L.LightningDataModule)), None)
        preflight(trainer, trainer.lightning_module, datamodule)
    environment = trainer.strategy.cluster_environment  # one node: rendezvous on a file, nothing listens outside
    launches = environment is not None and not environment.creates_processes_externally
    prepare_local_store(trainer.num_nodes, fresh_store, launches_ranks=launches, ranks=ranks)


@contextlib.contextmanager
def _local_store_for_this_launch() -> Iterator[None]:
    """The file-store path set for this launch's ranks is not inherited by later, unrelated launches."""
    try:
        yield
    finally:
        os.environ.pop(STORE_ENV, None)


class PreflightSubprocessLauncher(compat.SubprocessScriptLauncher):
    """Lightning's popen launcher: checks the run first, then starts child ranks with this Hydra job's command.

    Lightning's launch, but with the project's guard over the child ranks instead of Lightning's
    (:mod:`src.engine.runtime.child_guard`: it leaves the watchdog time to name a failed rank); ``guards_children``
    False starts them unguarded.
    """

    guards_children = True

    def launch(self, function: Callable, *args: Any, trainer: L.Trainer | None = None, **kwargs: Any) -> Any:
        _preflight_launch(trainer, args, fresh_store=False, ranks=self.procs)  # filled as the ranks start
        with _local_store_for_this_launch():
            self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
            if not self.cluster_environment.creates_processes_externally:
                self.start_child_ranks()
                if self.guards_children:
                    guard_child_ranks(self.procs)
            compat.set_num_threads_if_needed(self.num_processes)
            return function(*args, **kwargs)

    def start_child_ranks(self) -> None:
        """Start this node's other ranks, as Lightning's popen launcher does: each re-runs the command (under Hydra,
        this job's: :func:`child_command`) with the rendezvous and its local rank in its environment. A rank the
        entry script started early is given that command instead of a new process."""
        if self.procs:
            raise RuntimeError("The launcher can only create subprocesses once.")
        environment = self.cluster_environment
        if environment.local_rank() != 0:
            raise RuntimeError("a rank with LOCAL_RANK > 0 was asked to start ranks; fix: do not set LOCAL_RANK for "
                               "the process that starts the run")
        os.environ["MASTER_ADDR"] = environment.main_address
        os.environ["MASTER_PORT"] = str(environment.main_port)
        os.environ["NODE_RANK"] = str(environment.node_rank())
        os.environ["LOCAL_RANK"] = str(environment.local_rank())
        os.environ["WORLD_SIZE"] = f"{self.num_processes * self.num_nodes}"
        adopted = []
        for local_rank in range(1, self.num_processes):
            env = {**os.environ, "LOCAL_RANK": str(local_rank)}
            command, cwd = child_command(local_rank) if _hydra_initialized() else (_plain_command(), None)
            # a rank the entry script started early (src/engine/runtime/early_ranks.py) has imported already
            proc = early_ranks.adopt(local_rank, command, env, cwd)
            if proc is not None:
                adopted.append(local_rank)
            self.procs.append(proc or subprocess.Popen(command, env=env, cwd=cwd))
        early_ranks.end_unadopted()  # more were started early than this launch needs
        if adopted:
            log.info(f"local ranks {adopted} had started with the command: their imports are done")


class PreflightMultiprocessingLauncher(compat.MultiProcessingLauncher):
    """Lightning's spawn launcher: checks the run first, in the parent, before any rank starts; each rank logs
    where the parent logs, and a rank that lost its peer stops quietly (:class:`SpawnedRank`). A stop signal to
    the parent goes on to the ranks, and their stop is the parent's: its status and exit code say so."""

    ranks_position: str | None = None  # where the last fit ended, brought back from rank 0
    launched_by: int | None = None  # the pid of the process that started the ranks

    def launch(self, function: Callable, *args: Any, trainer: L.Trainer | None = None, **kwargs: Any) -> Any:
        _preflight_launch(trainer, args, fresh_store=True)
        self.launched_by = os.getpid()
        with _local_store_for_this_launch(), passed_on_to_spawned_ranks(self), shared_with_forked_ranks():
            try:
                return super().launch(SpawnedRank(function, _job_logging()), *args, trainer=trainer, **kwargs)
            except ProcessExitedException as err:  # the ranks stopped on a signal: this process reports the stop
                stop = stop_of_spawned_ranks(err, trainer)
                if stop is None:
                    raise
                raise stop from None

    def kill(self, signum: int) -> None:
        """Pass ``signum`` on to the ranks this process started; a rank's own copy of the launcher (spawned, or
        forked with the last launch's process list) has none."""
        if os.getpid() == self.launched_by:
            super().kill(signum)

    def get_extra_results(self, trainer: L.Trainer) -> dict[str, Any]:
        """On rank 0, after a fit: Lightning's extras, plus where the fit ended (the parent's trainer ran no loop)."""
        extra = super().get_extra_results(trainer)
        if trainer.state.fn == "fit":
            extra[_POSITION] = trainer_position(trainer)
        return extra

    def update_main_process_results(self, trainer: L.Trainer, extra: dict[str, Any]) -> None:
        """In the parent: keep the position brought back (read by ``run_position``), then Lightning's updates."""
        if _POSITION in extra:
            self.ranks_position = extra.pop(_POSITION)
        super().update_main_process_results(trainer, extra)


_POSITION = "src.ranks_position"  # a key of Lightning's extra results, which must not meet Lightning's own


def _job_logging() -> dict[str, Any] | None:
    """This Hydra job's logging config, resolved (console and ``<run dir>/<task>.log``); None outside Hydra."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    if not HydraConfig.initialized():
        return None
    return OmegaConf.to_container(HydraConfig.get().job_logging, resolve=True)


class SpawnedRank:
    """A spawned (or forked) rank's work. It first holds stop signals for the handlers its strategy installs
    (:func:`src.engine.runtime.sigterm.hold_stop_signals`). A spawned process starts with no logging set up, so it then
    takes the parent's Hydra job logging (its lines reach the console and the run's log file, tagged with its
    rank). When a collective lost its peer: one quiet line and a wait for the parent, which then names the rank
    that failed (torch's spawn reports the first rank to exit with an error). A spawned rank ends without the
    interpreter's teardown, once its exit handlers have run (:mod:`src.engine.runtime.prompt_exit`)."""

    def __init__(self, function: Callable, job_logging: dict[str, Any] | None) -> None:
        self.function, self.job_logging = function, job_logging

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        prompt_exit.end_spawned_process_promptly()  # a spawned rank only (not a forked one, nor a direct call)
        hold_stop_signals()
        if self.job_logging is not None:
            logging.config.dictConfig(self.job_logging)
        for module in (a for a in args if isinstance(a, nn.Module)):
            own_tensor_attributes(module)
        try:
            return self.function(*args, **kwargs)
        except SIGTERMException as err:  # its exit code is how the parent learns of the stop
            raise SystemExit(stop_exit_code(err)) from None
        except Exception as err:
            if peer_failed(err):
                exit_after_peer_failure(current_rank())
            raise


def own_tensor_attributes(module: nn.Module) -> None:
    """Give this rank its own copy of every CPU tensor that ``module`` and its submodules hold as plain attributes.

    Spawn hands the model to each rank through shared memory. Lightning copies the parameters and buffers out of
    it (CPU ranks), but not other tensors a module holds, such as torchmetrics' states: every rank would then add
    into one shared running sum, and a checkpoint would save the ranks' total as each rank's own state.
    """
    def own(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.is_shared():
            return value.clone()
        return value

    for sub in module.modules():
        for name, value in list(vars(sub).items()):
            if isinstance(value, list):
                owned = [own(v) for v in value]
                changed = any(o is not v for o, v in zip(owned, value, strict=True))
            else:
                owned = own(value)
                changed = owned is not value
            if changed:
                object.__setattr__(sub, name, owned)  # a plain attribute: not a parameter, buffer or submodule


class PSSubprocessLauncher(PreflightSubprocessLauncher):
    """The popen launcher of ``trainer=ps``: no guard over the child ranks.

    A guard ends every rank when one child exits non-zero; under ps a worker may die and the job goes on,
    and a server's failure is seen and named by the ranks that talk to it (:mod:`src.engine.strategies.ps`).
    """

    guards_children = False


# -- the command of a child rank under Hydra -------------------------------------------------------------
# Hydra overrides that describe the parent's sweep or that child_command sets itself, not the job a child must
# join. The job's other settings (hydra.job.chdir, hydra.job.env_set...) pass on: every rank runs the same job.
_PARENT_ONLY = ("hydra.mode", "hydra.run.", "hydra.sweep.", "hydra.job.name", "hydra.job.id", "hydra.job.num",
                "hydra.output_subdir", "hydra/sweeper", "hydra/launcher", "hydra.sweeper", "hydra.launcher")


def _hydra_initialized() -> bool:
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.initialized()


def _plain_command() -> list[str]:
    """This process's own command line (outside Hydra): a child rank re-runs it."""
    import __main__

    if __main__.__spec__ is None:
        return [sys.executable, os.path.abspath(sys.argv[0]), *sys.argv[1:]]
    return [sys.executable, "-m", __main__.__spec__.name, *sys.argv[1:]]


def child_command(local_rank: int) -> tuple[list[str], str]:
    """Command and cwd that start rank ``local_rank`` of the current Hydra job (run or multirun)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import get_original_cwd

    hc = HydraConfig.get()
    command = entry_command(hc)
    command += [o for o in hc.overrides.hydra if not o.lstrip("~+").startswith(_PARENT_ONLY)]
    command += list(hc.overrides.task)
    command += [
        f'hydra.run.dir="{hc.runtime.output_dir}"',
        f"hydra.job.name={hc.job.name}",  # same name -> same log file, each line tagged with its rank
        "hydra.output_subdir=null",  # only the parent writes .hydra/
        "hydra.mode=RUN",  # a search config may switch to multirun itself: a rank joins one job, never a sweep
    ]
    return command, get_original_cwd()
