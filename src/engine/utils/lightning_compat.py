"""The private Lightning and torch names the project still touches, each behind one small accessor.

Each accessor checks its private names when its feature runs (:func:`require`, on the live object), so a release
that renames one breaks that feature with one line naming the version and the feature, and nothing else. Only the
two launcher base classes are looked up at import (the project's launchers subclass them). Where Lightning or torch has a public way (the loops' progress counters, the profiler,
``dist.get_backend``, ``move_data_to_device``, a property override, the ``checkpoint_io`` setter,
``named_buffers``/``named_modules`` with ``setattr``) the project uses it instead;
``tests/test_private_names.py`` counts what remains by scanning the code. Checked against lightning 2.5.6 to 2.6.6 and
torch 2.14.1 (and run with torch 2.11 on a GPU machine).
"""

from __future__ import annotations

import contextlib
import ctypes
import inspect
import os
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

import lightning
import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import ModelParallelStrategy, Strategy
from lightning.pytorch.strategies.launchers import multiprocessing as mp_launcher
from lightning.pytorch.strategies.launchers import subprocess_script
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torchmetrics import Metric

CHECKED_AGAINST = "lightning 2.5.6 to 2.6.6 and torch 2.14.1"


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


def CalledIn(function: Callable) -> CodeNames:  # noqa: N802
    """The names ``function`` refers to: proves Lightning still *uses* a name the project swaps."""
    return CodeNames(function.__qualname__, function)


# -- launchers ---------------------------------------------------------------------------------------------
def _launcher_class(module: Any, name: str, feature: str) -> type:
    require(module, name, feature)
    return getattr(module, name)


# Lightning has no public launcher base: its own strategies build these private classes in _configure_launcher
# the base classes of the project's launchers (src.engine.strategies.launchers), looked up when that module defines them
SubprocessScriptLauncher = _launcher_class(subprocess_script, "_SubprocessScriptLauncher", "the popen launcher")
MultiProcessingLauncher = _launcher_class(mp_launcher, "_MultiProcessingLauncher", "the spawn launcher")


def set_num_threads_if_needed(num_processes: int) -> None:
    """Lightning's choice of torch threads per process when it starts ``num_processes`` on one machine: the CPUs
    this process may use, shared out, unless ``OMP_NUM_THREADS`` says otherwise."""
    if "OMP_NUM_THREADS" not in os.environ:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads = max(1, cpus // max(1, num_processes))
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


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
    # public only as __init__ arguments, and the world size is known after __init__ (the Trainer sets it)
    for name in ("_data_parallel_size", "_tensor_parallel_size"):
        require(strategy, name, "the fsdp device mesh")
    strategy._data_parallel_size = data_parallel
    strategy._tensor_parallel_size = tensor_parallel


def forget_mesh_groups(mesh: DeviceMesh) -> None:
    """Drop the process groups a DeviceMesh holds: the last Python references to its sub-groups, so destroying the
    default group joins their gloo threads (:mod:`src.engine.runtime.exit_cleanup`). A slice's groups may be held
    by the mesh it was sliced from: pass that one too."""
    # no public way to release them: the mesh lives on in the sharded parameters (DTensor.device_mesh)
    require(mesh, "_pg_registry", "fsdp's sub-groups released before the group is destroyed")
    mesh._pg_registry.clear()


def accept_sync_batchnorm(strategy: Strategy) -> None:
    """Give a strategy that is not Lightning's DDP the slot where the Trainer puts ``sync_batchnorm``'s plugin
    (it fills it only where it exists), so the strategy can see the request and refuse it."""
    # the Trainer keeps sync_batchnorm nowhere public; it hands the plugin to this slot only
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
    # Lightning has no setting for its per-batch broadcast or its SIGTERM handler: both are swapped in place
    loop, feature = trainer.fit_loop.epoch_loop, "the agreed SIGTERM stop"
    require(loop, _PER_BATCH_CHECK, feature)
    require(CalledIn(type(loop).advance), _PER_BATCH_CHECK, feature)
    require(trainer, "_signal_connector", feature)
    connector = trainer._signal_connector
    require(connector, _SIGTERM_HANDLER, feature)
    require(CalledIn(type(connector).register_signal_handlers), _SIGTERM_HANDLER, feature)
    setattr(trainer.fit_loop.epoch_loop, _PER_BATCH_CHECK, per_batch_check)
    setattr(trainer._signal_connector, _SIGTERM_HANDLER, handler)


def per_batch_check_of(trainer: Trainer) -> Any:
    """What runs before every training batch in place of Lightning's SIGTERM broadcast (None: Lightning's own)."""
    return vars(trainer.fit_loop.epoch_loop).get(_PER_BATCH_CHECK)


def mark_sigterm_received(trainer: Trainer) -> None:
    """Tell Lightning this rank was signalled, so it stops (and its callbacks see it) as after its own handler."""
    # trainer.received_sigterm is a read-only property of the connector's flag
    require(trainer, "_signal_connector", "the SIGTERM stop")
    trainer._signal_connector.received_sigterm = True


# -- module and optimizer speed/placement --------------------------------------------------------------
class FastHookName:
    """Mixin for a LightningModule: stores Lightning's ``_current_fx_name`` without ``nn.Module.__setattr__``.

    Lightning writes the current hook's name about 40 times per training step; ``nn.Module.__setattr__``
    checks each write against parameters, submodules and buffers. A string is none of them.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "_current_fx_name":  # Lightning's own attribute, written by its hooks; no public setting
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
    # torchmetrics keeps dist_reduce_fx only there (merge_state weighs a mean by update count instead)
    require(metric, "_reductions", "a running metric resumed on another number of ranks")
    return dict(metric._reductions)


def backend_supports_coalescing(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether ``group``'s backend for ``device`` batches point-to-point calls (nccl does, gloo does not)."""
    try:
        backend = dist.get_backend(group)  # "nccl", or "cpu:gloo,cuda:nccl" for a group of several backends
    except (RuntimeError, ValueError):
        return False
    if ":" in backend:
        backend = dict(part.split(":", 1) for part in backend.split(",")).get(device.type, "")
    return backend == "nccl" and device.type == "cuda"


def collectives_entered() -> int:
    """How many collectives this rank has entered on the default group (its sequence number; 0 before it exists).

    Every rank of a group counts the same collectives in the same order, so a rank with a lower count has
    not joined a collective the others wait in.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    group = dist.group.WORLD  # torch counts collectives per group, and shows the count nowhere public
    require(group, "_get_sequence_number_for_group", "naming a stuck rank (collectives it entered)")
    return int(group._get_sequence_number_for_group())


def optimizers_to_device(optimizers: list, device: torch.device) -> None:
    """Move every optimizer's state tensors to ``device``, as Lightning's strategies do: ``step`` stays where it is
    (torch's optimizers want it on the CPU)."""
    for optimizer in optimizers:
        optimizer = getattr(optimizer, "optimizer", optimizer)  # a LightningOptimizer wraps the optimizer
        for param, value in optimizer.state.items():
            if isinstance(value, MutableMapping):
                for key, item in value.items():
                    if key != "step":
                        value[key] = move_data_to_device(item, device)
            else:
                optimizer.state[param] = apply_to_collection(value, Tensor, move_data_to_device, device,
                                                             allow_frozen=True)


# -- dp: CPU replicas that share the root's parameters -------------------------------------------------
def replica_sharing_parameters(module: nn.Module) -> nn.Module:
    """A replica of ``module`` that uses the SAME parameter tensors and private copies of the buffers.

    Gradients of every replica accumulate into the shared ``.grad``; in-place buffer updates
    (BatchNorm running stats) go to the copies and are dropped, as with ``nn.DataParallel``, where
    only device 0's replica shares the root's buffers. Built like ``torch.nn.parallel.replicate``,
    whose broadcast step needs CUDA.
    """
    for name in ("_replicate_for_data_parallel", "_parameters"):
        require(module, name, "dp replicas on CPU")
    # torch's own copy for replicate(): the instance dict, with the buffer and submodule slots copied, not shared
    copies = {m: m._replicate_for_data_parallel() for m in module.modules()}
    for original, replica in copies.items():
        replica._parameters = dict(original._parameters)  # the same tensors; a None slot (bias=False) stays
        for name, buffer in original.named_buffers(recurse=False, remove_duplicate=False):
            setattr(replica, name, buffer.clone())  # a None buffer stays None
    paths = dict(module.named_modules(remove_duplicate=False))  # every name a submodule is held under
    for path, child in paths.items():
        if path:
            parent, _, name = path.rpartition(".")
            setattr(copies[paths[parent]], name, copies[child])
    return copies[module]


def point_replica_at(replica: nn.Module, device: torch.device) -> None:
    """So ``self.device`` of a LightningModule/Metric replica made by ``nn.parallel.replicate`` is its own."""
    # a module's device is set publicly only by moving its tensors, which the replicas must not do
    if isinstance(replica, LightningModule):
        require(replica, "_device", "dp replicas on their own devices")
    for sub in replica.modules():
        if "_device" in sub.__dict__:
            sub._device = device


def bound_forwards(module: nn.Module) -> list[str]:
    """Submodules whose forward is bound to the instance: a patched ``forward`` or ``nn.Module.compile``.

    A replica copies the instance ``__dict__``, so such a forward would still run the original
    module's parameters instead of the replica's.
    """
    # nn.Module.compile() leaves no public mark but this slot
    require(module, "_compiled_call_impl", "dp refusing compiled modules")
    return [name or "<root>" for name, m in module.named_modules()
            if "forward" in m.__dict__ or m.__dict__.get("_compiled_call_impl") is not None]


def epoch_ran_to_end(trainer: Trainer) -> bool:
    """Whether the training epoch that is ending ran all its batches: Lightning's own test before it steps a
    plateau scheduler (a stop at ``max_steps`` mid-epoch does not step one)."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    return progress.current.ready == trainer.num_training_batches or progress.is_last_batch


def validation_follows(trainer: Trainer) -> bool:
    """Whether Lightning validates after the training batch that is ending (asked in ``on_train_batch_end``).

    A checkpoint saved before that validation skips it on resume: Lightning fast-forwards a validation that
    was due at the batch a fit restarts from."""
    loop, feature = trainer.fit_loop, "no periodic last.ckpt between a step and the validation due after it"
    # Lightning's own decision, taken from its loop; no public one (a copy would drift from its rules)
    require(loop, "_data_fetcher", feature)
    require(loop.epoch_loop, "_should_check_val_fx", feature)
    return loop._data_fetcher is not None and loop.epoch_loop._should_check_val_fx(loop._data_fetcher)


def fit_ends_on_should_stop(trainer: Trainer) -> bool:
    """Whether ``should_stop`` ends the fit at its next check: Lightning honours it once ``min_epochs`` and
    ``min_steps`` are met, and trains on until then."""
    loop = trainer.fit_loop
    met_min_epochs = loop.epoch_progress.current.processed >= loop.min_epochs if loop.min_epochs else True
    met_min_steps = loop.epoch_loop.global_step >= loop.min_steps if loop.min_steps else True
    return trainer.should_stop and met_min_epochs and met_min_steps


def log_training_epoch_now(trainer: Trainer) -> None:
    """Write the ending training epoch's metrics to the loggers now (call in ``on_train_epoch_end``).

    Lightning's loop writes them after every epoch-end hook, so a checkpoint saved in one of those hooks holds
    an epoch that its logs do not, and a fit resumed from it (as from an epoch's end) never writes them.
    Here the loop's own calls run early: the epoch's values reach the progress bar and callback metrics, the
    row is logged at the step Lightning logs an epoch's end at, and the results are reset, so the loop's
    later calls find nothing left to write."""
    feature = "an epoch's training row written before its last.ckpt"  # the loop's own calls: no public logging
    # entry point writes an epoch's row at Lightning's step and resets it
    require(trainer, "_logger_connector", feature)
    require(trainer.fit_loop.epoch_loop, "_batches_that_stepped", feature)
    for name in ("update_train_epoch_metrics", "_batches_that_stepped"):  # the loop's own calls this runs early
        require(CalledIn(type(trainer.fit_loop).on_advance_end), name, feature)
    connector, epoch_loop = trainer._logger_connector, trainer.fit_loop.epoch_loop
    connector.on_epoch_end()
    epoch_loop._batches_that_stepped -= 1
    try:
        connector.update_train_epoch_metrics()
    finally:
        epoch_loop._batches_that_stepped += 1


# -- a checkpoint's optimizer-step counters, automatic and manual optimization --------------------------
_AUTOMATIC_STEPS = "epoch_loop.automatic_optimization.optim_progress"  # {"optimizer": {"step": Progress}}
_MANUAL_STEPS = "epoch_loop.manual_optimization.optim_step_progress"  # Progress


@contextlib.contextmanager
def counted_manual_step(trainer: Trainer) -> Iterator[None]:
    """Around an optimizer step that runs without Lightning's ``optimizer.step()`` under manual optimization (a
    graph replay, or the owned step's direct call): what that call does around the step. The manual-optimization
    progress counts it (``global_step`` and checkpoints follow the count), and the profiler's ``optimizer_step``
    entry times it."""
    progress = trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress
    progress.increment_ready()
    trainer.profiler.start("optimizer_step")
    yield
    trainer.profiler.stop("optimizer_step")
    progress.increment_completed()


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
