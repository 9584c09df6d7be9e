"""Every private Lightning and torch name the project touches, in one place, checked at import.

This module holds names and guards only: each private name is reached through one small accessor or
alias below, and the features that use them live with their owners (the launchers in
:mod:`src.strategies.launchers`, the SIGTERM agreement in :mod:`src.runtime.sigterm`, dp replicas in
:mod:`src.strategies.dp.shards`). All were checked against lightning 2.6.6 and torch 2.14.1 (and run with
torch 2.11 on a GPU machine). If a release renames one of these names, importing this module fails
with one line naming the version and the feature, never a silent no-op.
"""

from __future__ import annotations

import contextlib
import ctypes
import inspect
import os
from collections.abc import Callable, Iterator
from typing import Any

import lightning
import torch
import torch.distributed as dist
from lightning.fabric.utilities import distributed as fabric_distributed
from lightning.fabric.utilities import optimizer as fabric_optimizer
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Timer
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.loops import fit_loop, training_epoch_loop
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy, Strategy
from lightning.pytorch.strategies.launchers import multiprocessing as mp_launcher
from lightning.pytorch.strategies.launchers import subprocess_script
from lightning.pytorch.trainer.connectors import accelerator_connector, signal_connector
from torch import nn
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.device_mesh import DeviceMesh
from torchmetrics import Metric

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
    """Names that functions' code refers to (``co_names``, and names given as strings, as ``nn.Module`` sets its
    own): attributes an ``__init__`` assigns, or names a method still calls. Answers ``hasattr`` for them,
    so :func:`require` checks code without running it. A function that wraps another through a closure (as
    ``torch.compile`` wraps ``nn.Module.__init__``) is read with the function it wraps."""

    def __init__(self, label: str, *functions: Callable) -> None:
        self.__name__ = label
        self.names = frozenset(name for f in functions for name in _code_names(f))

    def __getattr__(self, name: str) -> Any:
        if name in self.__dict__.get("names", ()):
            return True
        raise AttributeError(name)


def _code_names(function: Callable, seen: frozenset[int] = frozenset()) -> set[str]:
    function = inspect.unwrap(function)
    code = getattr(function, "__code__", None)
    if code is None or id(function) in seen:
        return set()
    names = {n for n in (*code.co_names, *code.co_consts) if isinstance(n, str)}
    for cell in getattr(function, "__closure__", None) or ():
        try:
            inner = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if callable(inner):
            names |= _code_names(inner, seen | {id(function)})
    return names


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
    (lambda: subprocess_script, "_SubprocessScriptLauncher", "the pre-flight launcher (popen)"),
    (lambda: subprocess_script._SubprocessScriptLauncher, "_call_children_scripts", "the per-job Hydra child command"),
    (lambda: CalledIn(subprocess_script._SubprocessScriptLauncher._call_children_scripts), "_hydra_subprocess_cmd",
     "the per-job Hydra child command"),
    (lambda: mp_launcher, "_MultiProcessingLauncher", "the pre-flight launcher (spawn)"),
    (lambda: DDPStrategy, "_configure_launcher", "the pre-flight launcher"),
    (lambda: accelerator_connector, "_AcceleratorConnector", "the pre-flight launcher"),
    (lambda: accelerator_connector._AcceleratorConnector, "_lazy_init_strategy", "the pre-flight launcher"),
    (lambda: CalledIn(accelerator_connector._AcceleratorConnector._lazy_init_strategy), "_configure_launcher",
     "the pre-flight launcher"),
    (lambda: SetInInit(DDPStrategy), "_launcher", "the pre-flight launcher"),
    (lambda: SetInInit(DDPStrategy), "_start_method", "the pre-flight launcher"),
    (lambda: SetInInit(DDPStrategy), "_layer_sync", "refusing sync_batchnorm where it cannot apply"),
    (lambda: training_epoch_loop, "_TrainingEpochLoop", "the agreed SIGTERM stop"),
    (lambda: training_epoch_loop._TrainingEpochLoop, "_broadcast_sigterm_tensor", "the agreed SIGTERM stop"),
    (lambda: CalledIn(training_epoch_loop._TrainingEpochLoop.advance), "_broadcast_sigterm_tensor",
     "the agreed SIGTERM stop"),
    (lambda: training_epoch_loop._TrainingEpochLoop, "_num_ready_batches_reached",
     "a plateau scheduler stepped before the epoch's checkpoint"),
    (lambda: training_epoch_loop._TrainingEpochLoop, "_should_check_val_fx",
     "no periodic last.ckpt between a step and the validation due after it"),
    (lambda: fit_loop, "_FitLoop", "no periodic last.ckpt between a step and the validation due after it"),
    (lambda: fit_loop._FitLoop, "_can_stop_early", "a stop signal waiting for the fit's final save"),
    (lambda: SetInInit(Timer), "_duration", "a fit stopped by max_time, resumed under the same limit"),
    (lambda: SetInInit(fit_loop._FitLoop), "_data_fetcher",
     "no periodic last.ckpt between a step and the validation due after it"),
    (lambda: SetInInit(Trainer), "_logger_connector", "an epoch's training row written before its last.ckpt"),
    (lambda: SetInInit(training_epoch_loop._TrainingEpochLoop), "_batches_that_stepped",
     "an epoch's training row written before its last.ckpt"),
    (lambda: CalledIn(fit_loop._FitLoop.on_advance_end), "update_train_epoch_metrics",
     "an epoch's training row written before its last.ckpt"),
    (lambda: CalledIn(fit_loop._FitLoop.on_advance_end), "_batches_that_stepped",
     "an epoch's training row written before its last.ckpt"),
    (lambda: signal_connector, "_SignalConnector", "the agreed SIGTERM stop"),
    (lambda: signal_connector._SignalConnector, "_sigterm_notifier_fn", "the agreed SIGTERM stop"),
    (lambda: CalledIn(signal_connector._SignalConnector.register_signal_handlers), "_sigterm_notifier_fn",
     "the agreed SIGTERM stop"),
    (lambda: SetInInit(signal_connector._SignalConnector), "received_sigterm", "the SIGTERM stop outside fit"),
    (lambda: SetInInit(Trainer), "_signal_connector", "the agreed SIGTERM stop"),
    (lambda: SetInInit(LightningModule), "_current_fx_name", "fast hook-name writes"),
    (lambda: SetInInit(LightningOptimizer), "_on_before_step", "counting a replayed (captured) step"),
    (lambda: SetInInit(LightningOptimizer), "_on_after_step", "counting a replayed (captured) step"),
    (lambda: SetInInit(DDPStrategy), "_model_averager", "the owned step's direct optimizer step"),
    (lambda: fabric_optimizer, "_optimizers_to_device", "moving a pipeline stage's optimizer state"),
    (lambda: nn.Module, "_replicate_for_data_parallel", "dp replicas on CPU"),
    (lambda: SetInInit(nn.Module), "_parameters", "dp replicas on CPU"),
    (lambda: SetInInit(nn.Module), "_buffers", "dp replicas on CPU"),
    (lambda: SetInInit(nn.Module), "_modules", "dp replicas on CPU"),
    (lambda: nn.Module, "_compiled_call_impl", "dp refusing compiled modules"),
    (lambda: SetInInit(LightningModule), "_device", "dp replicas on their own devices"),
    (lambda: SetInInit(Strategy), "_checkpoint_io", "atomic checkpoint saves by default"),
    (lambda: SetInInit(SingleDeviceStrategy), "_root_device", "the single-device strategy taking the Trainer's device"),
    (lambda: dist.ProcessGroup, "_get_backend", "the pipelined ring all-reduce (coalesced sends on nccl)"),
    (lambda: ModelParallelStrategy, "_configure_launcher", "the fsdp pre-flight launcher"),
    (lambda: SetInInit(ModelParallelStrategy), "_launcher", "the fsdp pre-flight launcher"),
    (lambda: SetInInit(ModelParallelStrategy), "_data_parallel_size", "the fsdp device mesh"),
    (lambda: SetInInit(ModelParallelStrategy), "_tensor_parallel_size", "the fsdp device mesh"),
    (lambda: SetInInit(DeviceMesh), "_pg_registry", "fsdp's sub-groups released before the group is destroyed"),
    (lambda: SetInInit(DeviceMesh), "_root_mesh", "fsdp's sub-groups released before the group is destroyed"),
    (lambda: torch.serialization, "_get_layout", "reading sharded checkpoints' metadata without running code"),
    (lambda: dcp_filesystem, "_StorageInfo", "reading sharded checkpoints' metadata without running code"),
    (lambda: dcp_metadata, "_MEM_FORMAT_ENCODING", "reading sharded checkpoints' metadata without running code"),
    (lambda: dist.distributed_c10d, "_get_default_group", "naming a stuck rank (collectives it entered)"),
    (lambda: dist.ProcessGroup, "_get_sequence_number_for_group", "naming a stuck rank (collectives it entered)"),
    (lambda: torch, "_C", "a stuck rank's flight-recorder record"),
    (lambda: torch._C, "_distributed_c10d", "a stuck rank's flight-recorder record"),
    (lambda: torch._C._distributed_c10d, "_dump_fr_trace", "a stuck rank's flight-recorder record"),
    (lambda: fabric_distributed, "_set_num_threads_if_needed", "the ps launcher"),
    (lambda: SetInInit(Metric), "_reductions", "a running metric resumed on another number of ranks"),
    (lambda: CalledIn(subprocess_script._SubprocessScriptLauncher.launch), "_call_children_scripts",
     "the popen launchers (Lightning's launch with the project's guard over child ranks)"),
    (lambda: CalledIn(subprocess_script._SubprocessScriptLauncher.launch), "_set_num_threads_if_needed",
     "the popen launchers (Lightning's launch with the project's guard over child ranks)"),
    (lambda: CalledIn(subprocess_script._SubprocessScriptLauncher.launch), "_launch_process_observer",
     "the popen launchers (Lightning's launch with the project's guard over child ranks)"),
)


def check_private_names(names: tuple[tuple[Callable[[], Any], str, str], ...] = PRIVATE_NAMES) -> None:
    """Check every private name the project uses; runs at import (tests run it with names taken away)."""
    for where, name, feature in names:
        require(where(), name, feature)


# -- launchers ---------------------------------------------------------------------------------------------
SubprocessScriptLauncher = subprocess_script._SubprocessScriptLauncher  # popen: re-runs the command per rank
MultiProcessingLauncher = mp_launcher._MultiProcessingLauncher  # spawn / fork
_HYDRA_CHILD_COMMAND = "_hydra_subprocess_cmd"  # subprocess_script: builds a child rank's command under Hydra


@contextlib.contextmanager
def hydra_child_command(command: Callable[[int], tuple[list[str], str]]) -> Iterator[None]:
    """Within the block, Lightning starts child ranks under Hydra with ``command(local_rank)``."""
    previous = getattr(subprocess_script, _HYDRA_CHILD_COMMAND)
    setattr(subprocess_script, _HYDRA_CHILD_COMMAND, command)
    try:
        yield
    finally:
        setattr(subprocess_script, _HYDRA_CHILD_COMMAND, previous)


def start_child_ranks(launcher: SubprocessScriptLauncher) -> None:
    """Lightning's popen launcher starts this node's other ranks (re-running the command), and nothing else."""
    launcher._call_children_scripts()


def set_num_threads_if_needed(num_processes: int) -> None:
    """Lightning's choice of torch threads per process when it starts ``num_processes`` on one machine."""
    fabric_distributed._set_num_threads_if_needed(num_processes=num_processes)


class BuildsLauncher:
    """Strategy mixin: Lightning builds a strategy's launcher in ``_configure_launcher``, the hook its own
    strategies override; this one builds whatever ``self.build_launcher()`` returns."""

    def _configure_launcher(self) -> None:
        self._launcher = self.build_launcher()

    def build_launcher(self) -> Any:
        raise NotImplementedError


def set_mesh_sizes(strategy: ModelParallelStrategy, data_parallel: int, tensor_parallel: int) -> None:
    """The ``data_parallel x tensor_parallel`` mesh Lightning builds in ``setup_environment``, once the world size is
    known (its ``"auto"`` puts every device of a node on the tensor-parallel axis)."""
    strategy._data_parallel_size = data_parallel
    strategy._tensor_parallel_size = tensor_parallel


def forget_mesh_groups(mesh: DeviceMesh) -> None:
    """Drop the process groups a DeviceMesh (and its root) holds: the last Python references to its sub-groups,
    so destroying the default group joins their gloo threads (:mod:`src.runtime.exit_cleanup`)."""
    for holder in (mesh, getattr(mesh, "_root_mesh", None)):
        if holder is not None:
            holder._pg_registry.clear()


def start_method_of(strategy: DDPStrategy) -> str:
    """The ``start_method`` a Lightning DDPStrategy was given (popen, spawn, fork, forkserver)."""
    return strategy._start_method


_CHECKPOINT_IO = "_checkpoint_io"  # Strategy: the CheckpointIO given to it (None: Lightning's default)


def given_checkpoint_io(strategy: Strategy) -> Any:
    """The CheckpointIO passed to ``strategy`` or set by the Trainer's ``plugins``, or None."""
    return getattr(strategy, _CHECKPOINT_IO)


def set_checkpoint_io(strategy: Strategy, io: Any) -> None:
    setattr(strategy, _CHECKPOINT_IO, io)


def set_root_device(strategy: SingleDeviceStrategy, device: torch.device) -> None:
    """Point a single-device strategy at ``device`` after it was built (Lightning sets it only in ``__init__``)."""
    strategy._root_device = device


def accept_sync_batchnorm(strategy: Strategy) -> None:
    """Give a strategy that is not Lightning's DDP the slot where the Trainer puts ``sync_batchnorm``'s plugin
    (it fills it only where it exists), so the strategy can see the request and refuse it."""
    strategy._layer_sync = None


def layer_sync_of(strategy: Strategy) -> Any:
    """The SyncBatchNorm plugin the Trainer gave ``strategy`` (``sync_batchnorm=True``), or None."""
    return getattr(strategy, "_layer_sync", None)


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


def per_batch_check_of(trainer: Trainer) -> Any:
    """What runs before every training batch in place of Lightning's SIGTERM broadcast (None: Lightning's own)."""
    return vars(trainer.fit_loop.epoch_loop).get(_PER_BATCH_CHECK)


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


_NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"  # torch: ask NVML, not the CUDA runtime, whether CUDA is there
_NVML_LIBRARY = "libnvidia-ml.so.1"  # the name torch.cuda loads for that check


def skip_nvml_check_without_nvml(load: Callable[[str], Any] = ctypes.CDLL) -> bool:
    """Drop Lightning's NVML switch where NVML cannot be loaded; return whether it was dropped.

    ``import lightning`` sets the switch so that ``torch.cuda.is_available()`` asks NVML and leaves the
    process safe to fork. Where NVML cannot be loaded (a CPU machine with a CUDA build of torch), torch
    then tries to load it on every call, fails, and asks the CUDA runtime anyway. Adam and AdamW call it
    at every ``step()``. Without the switch the answer and its side effects are the same, without the
    failed load. Where NVML loads, the switch stays.
    """
    if os.environ.get(_NVML_CHECK) != "1":
        return False
    try:
        load(_NVML_LIBRARY)
    except OSError:
        del os.environ[_NVML_CHECK]
        return True
    return False


def state_reductions(metric: Metric) -> dict[str, Callable | None]:
    """How a torchmetrics ``metric`` reduces each of its states across ranks (its ``dist_reduce_fx``, as a function
    of the states stacked along dim 0, e.g. ``torchmetrics.utilities.data.dim_zero_sum``)."""
    return dict(metric._reductions)


def backend_supports_coalescing(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether ``group``'s backend for ``device`` batches point-to-point calls (nccl does, gloo does not)."""
    try:
        return bool(getattr(group._get_backend(device), "supports_coalescing", False))
    except (RuntimeError, AttributeError):  # no backend registered for this device type
        return False


def collectives_entered() -> int:
    """How many collectives this rank has entered on the default group (its sequence number; 0 before it exists).

    Every rank of a group counts the same collectives in the same order, so a rank with a lower count has
    not joined a collective the others wait in.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return int(dist.distributed_c10d._get_default_group()._get_sequence_number_for_group())


def flight_recorder_dump() -> bytes:
    """torch's flight-recorder record of this process's collectives (a pickle; ``TORCH_FR_BUFFER_SIZE`` > 0
    must have been set before the process group was made): what ``python -m torch.distributed.flight_recorder.fr_trace``
    reads, as NCCL's own dump on a collective timeout writes it."""
    return torch._C._distributed_c10d._dump_fr_trace()


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


# -- sharded checkpoints: the globals a torch.distributed.checkpoint ``.metadata`` pickle names ---------------
def dcp_metadata_globals() -> dict[tuple[str, str], Any]:
    """``(module, name) -> object`` for every global torch writes into a ``.metadata`` file: its metadata
    dataclasses, ``torch.Size``, dtypes and layouts (by name), and paths. Nothing here runs code when called."""
    import pathlib

    meta = "torch.distributed.checkpoint.metadata"
    found: dict[tuple[str, str], Any] = {
        (meta, name): getattr(dcp_metadata, name)
        for name in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                     "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")
    }
    found[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = dcp_filesystem._StorageInfo
    found[("torch.serialization", "_get_layout")] = torch.serialization._get_layout  # a layout from its name
    found[("torch", "Size")] = torch.Size
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype | torch.layout | torch.memory_format):
            found[("torch", name)] = value
    found[("pathlib", "PosixPath")] = found[("pathlib", "WindowsPath")] = found[("pathlib", "Path")] = pathlib.Path
    return found


check_private_names()


def epoch_ran_to_end(trainer: Trainer) -> bool:
    """Whether the training epoch that is ending ran all its batches: Lightning's own test before it steps a
    plateau scheduler (a stop at ``max_steps`` mid-epoch does not step one)."""
    return trainer.fit_loop.epoch_loop._num_ready_batches_reached()


def validation_follows(trainer: Trainer) -> bool:
    """Whether Lightning validates after the training batch that is ending (asked in ``on_train_batch_end``).

    A checkpoint saved before that validation skips it on resume: Lightning fast-forwards a validation that
    was due at the batch a fit restarts from."""
    loop = trainer.fit_loop
    return loop._data_fetcher is not None and loop.epoch_loop._should_check_val_fx(loop._data_fetcher)


def fit_ends_on_should_stop(trainer: Trainer) -> bool:
    """Whether ``should_stop`` ends the fit at its next check: Lightning honours it once ``min_epochs`` and
    ``min_steps`` are met, and trains on until then."""
    return trainer.should_stop and trainer.fit_loop._can_stop_early


def timer_limits(trainer: Trainer) -> list[float | None]:
    """The ``max_time`` of each of the trainer's Timer callbacks, in seconds."""
    return [cb._duration for cb in trainer.callbacks if isinstance(cb, Timer)]


def log_training_epoch_now(trainer: Trainer) -> None:
    """Write the ending training epoch's metrics to the loggers now (call in ``on_train_epoch_end``).

    Lightning's loop writes them after every epoch-end hook, so a checkpoint saved in one of those hooks holds
    an epoch that its logs do not, and a fit resumed from it (as from an epoch's end) never writes them.
    Here the loop's own calls run early: the epoch's values reach the progress bar and callback metrics, the
    row is logged at the step Lightning logs an epoch's end at, and the results are reset, so the loop's
    later calls find nothing left to write."""
    connector, epoch_loop = trainer._logger_connector, trainer.fit_loop.epoch_loop
    connector.on_epoch_end()
    epoch_loop._batches_that_stepped -= 1
    try:
        connector.update_train_epoch_metrics()
    finally:
        epoch_loop._batches_that_stepped += 1


def strategy_adds_to_optimizer_step(strategy: Strategy) -> bool:
    """Whether ``strategy.optimizer_step`` does more than its precision plugin's step: an override of it, or
    DDP's post-local-SGD model averaging (``model_averaging_period``)."""
    step = type(strategy).optimizer_step
    if isinstance(strategy, DDPStrategy) and step is DDPStrategy.optimizer_step:
        return strategy._model_averager is not None
    return step is not Strategy.optimizer_step


# -- a checkpoint's optimizer-step counters, automatic and manual optimization --------------------------
_AUTOMATIC_STEPS = "epoch_loop.automatic_optimization.optim_progress"  # {"optimizer": {"step": Progress}}
_MANUAL_STEPS = "epoch_loop.manual_optimization.optim_step_progress"  # Progress


@contextlib.contextmanager
def counted_manual_step(optimizer: LightningOptimizer) -> Iterator[None]:
    """Around an optimizer step that runs without Lightning's ``optimizer.step()`` (a graph replay, or the owned
    step's direct call): what that call does around the step. The manual-optimization progress counts it
    (``global_step`` and checkpoints follow the count), and the profiler's ``optimizer_step`` entry times it."""
    optimizer._on_before_step()
    yield
    optimizer._on_after_step()


def carry_optimizer_steps(checkpoint: dict, to_manual: bool) -> None:
    """Copy the optimizer-step count of a checkpoint written in one optimization mode to the other's counter.

    Lightning counts ``global_step`` from the mode that runs, so a run resumed in the other mode would
    start again at step 0. Only a counter that is still zero is filled: the other mode never ran there.
    """
    fit = checkpoint.get("loops", {}).get("fit_loop")
    if fit is None:
        return
    if _AUTOMATIC_STEPS not in fit or _MANUAL_STEPS not in fit:
        raise LightningVersionError(f"lightning {lightning.__version__}: a checkpoint's fit loop has no "
                                    f"{_AUTOMATIC_STEPS!r} or {_MANUAL_STEPS!r} (checked against {CHECKED_AGAINST})")
    automatic = fit[_AUTOMATIC_STEPS]["optimizer"]["step"]
    manual = fit[_MANUAL_STEPS]
    source, target = (automatic, manual) if to_manual else (manual, automatic)
    if target["total"]["completed"] == 0 and source["total"]["completed"] > 0:
        for part in ("total", "current"):
            target[part] = {**target[part], **{k: source[part][k] for k in ("ready", "completed")}}
