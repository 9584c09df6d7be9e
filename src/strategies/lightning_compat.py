"""Every private Lightning and torch name the project touches, in one place, checked at import.

Lightning has no public setting for a few things the strategies need: a launcher that checks the
run before any rank starts, Hydra's per-job child command, a cheaper SIGTERM check, CPU replicas
for dp. Each is a small named function or mixin below, saying what it buys. All were checked
against lightning 2.6.6 and torch 2.14.1. If a release renames one of these names, importing this
module fails with one line naming the version and the feature, never a silent no-op.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Callable, Iterator
from typing import Any

import lightning
import torch
from lightning.fabric.utilities import optimizer as fabric_optimizer
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.strategies import DDPStrategy, Strategy
from lightning.pytorch.strategies.launchers import multiprocessing as mp_launcher
from lightning.pytorch.strategies.launchers import subprocess_script
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector
from torch import nn

CHECKED_AGAINST = "lightning 2.6.6 and torch 2.14.1"


class LightningVersionError(ImportError):
    """A private name the project relies on is missing from the installed Lightning or torch."""


def require(owner: Any, name: str, feature: str) -> None:
    """Raise :class:`LightningVersionError` when ``owner`` (module, class or instance) lacks ``name``."""
    if not hasattr(owner, name):
        where = getattr(owner, "__name__", None) or type(owner).__name__
        raise LightningVersionError(
            f"lightning {lightning.__version__} / torch {torch.__version__}: {where} has no {name!r}, which "
            f"{feature} needs; this project was checked against {CHECKED_AGAINST}: pin those versions"
        )


class CodeNames:
    """Names that functions' code refers to (``co_names``): attributes an ``__init__`` assigns, or names a
    method still calls. Answers ``hasattr`` for them, so :func:`require` checks code without running it."""

    def __init__(self, label: str, *functions: Callable) -> None:
        self.__name__ = label
        self.names = frozenset(n for f in functions for n in getattr(inspect.unwrap(f), "__code__", None).co_names)

    def __getattr__(self, name: str) -> Any:
        if name in self.__dict__.get("names", ()):
            return True
        raise AttributeError(name)


def SetInInit(cls: type) -> CodeNames:  # noqa: N802 - reads like the class it stands for
    """The instance attributes ``cls``'s ``__init__`` methods assign (nothing is built)."""
    inits = [k.__dict__["__init__"] for k in cls.__mro__ if callable(k.__dict__.get("__init__"))
             and hasattr(inspect.unwrap(k.__dict__["__init__"]), "__code__")]
    return CodeNames(cls.__name__, *inits)


def CalledIn(function: Callable) -> CodeNames:  # noqa: N802
    """The names ``function`` refers to: proves Lightning still *uses* a name the project swaps."""
    return CodeNames(function.__qualname__, function)


# (where to look, name, what needs it); "where" is called when checked
PRIVATE_NAMES: tuple[tuple[Callable[[], Any], str, str], ...] = (
    (lambda: subprocess_script, "_hydra_subprocess_cmd", "the per-job Hydra child command"),
    (lambda: CalledIn(subprocess_script._SubprocessScriptLauncher._call_children_scripts), "_hydra_subprocess_cmd",
     "the per-job Hydra child command"),
    (lambda: subprocess_script, "_SubprocessScriptLauncher", "the pre-flight launcher (popen)"),
    (lambda: mp_launcher, "_MultiProcessingLauncher", "the pre-flight launcher (spawn)"),
    (lambda: DDPStrategy, "_configure_launcher", "the pre-flight launcher"),
    (lambda: SetInInit(DDPStrategy), "_launcher", "the pre-flight launcher"),
    (lambda: SetInInit(DDPStrategy), "_layer_sync", "refusing sync_batchnorm where it cannot apply"),
    (lambda: _TrainingEpochLoop, "_broadcast_sigterm_tensor", "the agreed SIGTERM stop"),
    (lambda: CalledIn(_TrainingEpochLoop.advance), "_broadcast_sigterm_tensor", "the agreed SIGTERM stop"),
    (lambda: _SignalConnector, "_sigterm_notifier_fn", "the agreed SIGTERM stop"),
    (lambda: CalledIn(_SignalConnector.register_signal_handlers), "_sigterm_notifier_fn", "the agreed SIGTERM stop"),
    (lambda: SetInInit(_SignalConnector), "received_sigterm", "the SIGTERM stop outside fit"),
    (lambda: SetInInit(Trainer), "_signal_connector", "the agreed SIGTERM stop"),
    (lambda: SetInInit(LightningModule), "_current_fx_name", "fast hook-name writes"),
    (lambda: fabric_optimizer, "_optimizers_to_device", "moving a pipeline stage's optimizer state"),
    (lambda: nn.Module, "_replicate_for_data_parallel", "dp replicas on CPU"),
    (lambda: SetInInit(Strategy), "_checkpoint_io", "atomic checkpoint saves by default"),
)


def check_private_names(names: tuple[tuple[Callable[[], Any], str, str], ...] = PRIVATE_NAMES) -> None:
    """Check every private name the project uses; runs at import (tests run it with names taken away)."""
    for where, name, feature in names:
        require(where(), name, feature)


# -- launchers: pre-flight checks and Hydra's per-job child command --------------------------------
_HYDRA_CHILD_COMMAND = "_hydra_subprocess_cmd"  # subprocess_script: builds a child rank's command under Hydra


@contextlib.contextmanager
def hydra_child_command(command: Callable[[int], tuple[list[str], str]]) -> Iterator[None]:
    """Within the block, Lightning starts child ranks under Hydra with ``command(local_rank)``.

    Stock Lightning replays the parent's ``sys.argv``, which in a multirun is the whole sweep.
    """
    previous = getattr(subprocess_script, _HYDRA_CHILD_COMMAND)
    setattr(subprocess_script, _HYDRA_CHILD_COMMAND, command)
    try:
        yield
    finally:
        setattr(subprocess_script, _HYDRA_CHILD_COMMAND, previous)


def _run_preflight(trainer: Trainer | None, args: tuple, fresh_store: bool) -> None:
    from src.strategies.local_store import prepare_local_store
    from src.strategies.preflight import preflight  # the project's checks; imported late (no cycle)

    if trainer is not None and trainer.lightning_module is not None:
        datamodule = next((a for a in args if isinstance(a, lightning.LightningDataModule)), None)
        preflight(trainer, trainer.lightning_module, datamodule)
    if trainer is not None:
        environment = trainer.strategy.cluster_environment  # one node: rendezvous on a file, nothing listens outside
        launches = environment is not None and not environment.creates_processes_externally
        prepare_local_store(trainer.num_nodes, fresh_store, launches_ranks=launches)


@contextlib.contextmanager
def local_store_for_this_launch() -> Iterator[None]:
    """The file-store path set for this launch's ranks is not inherited by later, unrelated launches."""
    from src.strategies.local_store import STORE_ENV

    try:
        yield
    finally:
        os.environ.pop(STORE_ENV, None)


class PreflightSubprocessLauncher(subprocess_script._SubprocessScriptLauncher):
    """Lightning's popen launcher: checks the run first, then starts child ranks with this Hydra job's command."""

    def launch(self, function: Callable, *args: Any, trainer: Trainer | None = None, **kwargs: Any) -> Any:
        from src.strategies.hydra_child import child_command

        _run_preflight(trainer, args, fresh_store=False)
        with hydra_child_command(child_command), local_store_for_this_launch():
            return super().launch(function, *args, trainer=trainer, **kwargs)


class PreflightMultiprocessingLauncher(mp_launcher._MultiProcessingLauncher):
    """Lightning's spawn launcher: checks the run first, in the parent, before any rank starts."""

    def launch(self, function: Callable, *args: Any, trainer: Trainer | None = None, **kwargs: Any) -> Any:
        _run_preflight(trainer, args, fresh_store=True)
        with local_store_for_this_launch():
            return super().launch(function, *args, trainer=trainer, **kwargs)


class PreflightLaunch:
    """Mixin for a :class:`DDPStrategy` subclass: its launcher runs :func:`src.strategies.preflight.preflight`.

    ``_configure_launcher`` is the hook Lightning's own strategies override to pick a launcher.
    """

    def _configure_launcher(self) -> None:
        super()._configure_launcher()  # Lightning's choice of launcher, then the same launcher with the pre-flight
        swap = {subprocess_script._SubprocessScriptLauncher: PreflightSubprocessLauncher,
                mp_launcher._MultiProcessingLauncher: PreflightMultiprocessingLauncher}
        launcher_cls = swap.get(type(self._launcher))
        if launcher_cls is None:
            raise LightningVersionError(f"lightning {lightning.__version__} picked a {type(self._launcher).__name__} "
                                        f"launcher, which the pre-flight does not know; checked against {CHECKED_AGAINST}")
        self._launcher.__class__ = launcher_cls  # a subclass that only overrides launch(): no state to convert


_CHECKPOINT_IO = "_checkpoint_io"  # Strategy: the CheckpointIO given to it (None: Lightning's default)


def given_checkpoint_io(strategy: Strategy) -> Any:
    """The CheckpointIO passed to ``strategy`` or set by the Trainer's ``plugins``, or None."""
    return getattr(strategy, _CHECKPOINT_IO)


def set_checkpoint_io(strategy: Strategy, io: Any) -> None:
    setattr(strategy, _CHECKPOINT_IO, io)


def layer_sync_of(strategy: Strategy) -> Any:
    """The SyncBatchNorm plugin the Trainer gave ``strategy`` (``sync_batchnorm=True``), or None."""
    return getattr(strategy, "_layer_sync", None)


# -- resume: a checkpoint saved on the last batch of an epoch -----------------------------------------
def end_restart_on_last_batch(trainer: Trainer) -> bool:
    """Work around a Lightning 2.6 restart bug; True when it applied.

    Resuming from a checkpoint saved in ``on_train_batch_end`` of an epoch's last batch (a periodic
    or preemption checkpoint), the fit loop's ``reset`` finishes that epoch but keeps its
    ``restarted_mid_epoch`` stage for the whole next epoch. That epoch is then never counted as
    started, and ``on_train_epoch_start`` is skipped. A checkpoint taken in that epoch holds
    counters that a second resume reads as "epoch finished": that epoch runs again. Call this at
    ``on_train_start``, after ``reset`` and before the next epoch begins. Every name it uses is
    public.
    """
    loop = trainer.fit_loop
    if loop.restarted_mid_epoch and loop.epoch_loop.batch_progress.is_last_batch:
        loop.reset_restart_stage()
        return True
    return False


# -- SIGTERM: replace Lightning's per-batch broadcast with an agreement every N batches --------------
_PER_BATCH_CHECK = "_broadcast_sigterm_tensor"  # _TrainingEpochLoop: a broadcast + host sync before every batch
_SIGTERM_HANDLER = "_sigterm_notifier_fn"  # _SignalConnector: the SIGTERM handler registered at each run


def replace_sigterm_check(trainer: Trainer, per_batch_check: Callable[[], None],
                          handler: Callable[[int, Any], None]) -> None:
    """Install ``per_batch_check`` before every training batch and ``handler`` as the SIGTERM handler.

    Must run before Lightning registers its signal handlers (the strategy's ``setup`` does).
    """
    setattr(trainer.fit_loop.epoch_loop, _PER_BATCH_CHECK, per_batch_check)
    setattr(trainer._signal_connector, _SIGTERM_HANDLER, handler)


def mark_sigterm_received(trainer: Trainer) -> None:
    """Tell Lightning this rank was signalled, so it stops (and its callbacks see it) as after its own handler."""
    trainer._signal_connector.received_sigterm = True


# -- module and optimizer speed/placement --------------------------------------------------------------
class FastHookName:
    """Mixin for a LightningModule: stores Lightning's ``_current_fx_name`` without ``nn.Module.__setattr__``.

    Lightning writes the current hook's name about 40 times per training step; ``nn.Module.__setattr__``
    checks each write against parameters, submodules and buffers. A string is none of them.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "_current_fx_name":
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)


_NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"  # torch: check CUDA availability through NVML


def cheap_cuda_check_without_gpus() -> None:
    """On a machine with no visible GPU, make ``torch.cuda.is_available()`` cheap again.

    ``import lightning`` sets the NVML switch so availability checks do not initialise CUDA before a
    fork. Every ``optimizer.step()`` asks whether CUDA is available; with the switch and no GPU a
    CUDA build of torch loads NVML each time. Without a GPU no CUDA state exists for a fork to break.
    """
    if os.environ.get(_NVML_CHECK) == "1" and not torch.cuda.is_available():
        os.environ[_NVML_CHECK] = "0"


def optimizers_to_device(optimizers: list, device: torch.device) -> None:
    """Move every optimizer's state tensors to ``device`` (Lightning's own helper)."""
    fabric_optimizer._optimizers_to_device(optimizers, device)


# -- dp: CPU replicas that share the root's parameters -------------------------------------------------
def replica_sharing_parameters(module: nn.Module) -> nn.Module:
    """A replica of ``module`` that uses the SAME parameter tensors and private copies of the buffers.

    Gradients of every replica accumulate into the shared ``.grad``; in-place buffer updates
    (BatchNorm running stats) go to the copies and are dropped, as with ``nn.DataParallel``, where
    only device 0's replica shares the root's buffers. Built like ``torch.nn.parallel.replicate``,
    whose broadcast step needs CUDA.
    """
    copies = {m: m._replicate_for_data_parallel() for m in module.modules()}
    for original, replica in copies.items():
        replica._parameters = dict(original._parameters)
        replica._buffers = {k: None if b is None else b.clone() for k, b in original._buffers.items()}
        replica._modules = {k: None if c is None else copies[c] for k, c in original._modules.items()}
    return copies[module]


def point_replica_at(replica: nn.Module, device: torch.device) -> None:
    """So ``self.device`` of a LightningModule/Metric replica made by ``nn.parallel.replicate`` is its own."""
    for sub in replica.modules():
        if "_device" in sub.__dict__:
            sub._device = device


def bound_forwards(module: nn.Module) -> list[str]:
    """Submodules whose forward is bound to the instance: a patched ``forward`` or ``nn.Module.compile``.

    A replica copies the instance ``__dict__``, so such a forward would still run the original
    module's parameters instead of the replica's.
    """
    return [name or "<root>" for name, m in module.named_modules()
            if "forward" in m.__dict__ or m.__dict__.get("_compiled_call_impl") is not None]


# -- pipeline: torch's single-stage schedule internals that the prefetching schedules call --------------
# src/strategies/pipeline/schedule.py overrides ``_step_microbatches`` of ScheduleGPipe/Schedule1F1B and
# calls these. Where a torch release lacks one, the pipeline falls back to torch's own classes (slower,
# same maths) instead of failing, so they are checked per schedule, not at import.
PIPELINE_SCHEDULE_INTERNALS = ("_step_microbatches", "_check_inputs", "_initialize_stage", "_maybe_compute_loss",
                               "_maybe_get_loss", "_update_losses", "_stage", "_has_backward", "_n_microbatches",
                               "_num_stages")
PIPELINE_STAGE_API = ("get_fwd_recv_ops", "get_bwd_recv_ops", "get_fwd_send_ops", "get_bwd_send_ops",
                      "forward_one_chunk", "backward_one_chunk", "perform_reduce_grad")


def has_pipeline_internals(schedule: Any) -> bool:
    """Whether a built single-stage schedule (and its stage class) has every internal the prefetching body uses."""
    stage_cls = type(getattr(schedule, "_stage", None))
    return (all(hasattr(schedule, name) for name in PIPELINE_SCHEDULE_INTERNALS)
            and all(hasattr(stage_cls, name) for name in PIPELINE_STAGE_API))


check_private_names()
