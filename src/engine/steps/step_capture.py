"""The owned training step, captured once as a CUDA graph and replayed: one launch in place of dozens.

A small model's step on a GPU is launch-bound: the GPU waits on Python and on kernel launches, not on
maths. PyTorch's whole-network capture (``torch.cuda.graph``) records forward, loss, backward and the
optimizer step once; each later step copies the batch into the captured input buffers and replays. What
a capture needs, and where this module provides it:

* eager steps first (``WARMUP_STEPS``, on a side stream, as torch's CUDA-graph notes ask), so lazy
  set-up and the optimizer's state exist before capture;
* every tensor the step reads or writes keeps its address: parameters and optimizer state are updated
  in place, the batch is copied into static buffers, gradients live in the graph's pool;
* no host sync inside the step, no Python work that must run on every step (what runs only at capture
  time is dropped at replay: Lightning's step counter is counted here, metric updates and logging run
  eagerly on the replay's outputs, schedulers run eagerly between replays);
* floats baked in: a learning rate, betas, momentum or weight decay is a Python value read at capture
  time. A change of any group setting (an epoch-interval scheduler, OneCycleLR's momentum cycle, code that
  assigns ``param_group["lr"]``) triggers a fresh capture before the next replay; a step-interval
  scheduler would re-capture every step for its learning rate, so that becomes a device tensor that the
  scheduler fills in place;
* autocast without its weight-cast cache inside the capture (the cache would hold casts from outside it).

The graph is replayed only for batches of the captured shape: a ragged last batch runs the eager step.

What runs inside the capture must be known to be graph-safe: no host sync (``.item()``, ``bool(tensor)``), no
Python-side random draw or branch on data (a replay would repeat the capture's choice, silently). ``auto``
captures only networks that declare it, ``capture_safe = True`` in their own class body (the declaration is
not inherited: a subclass may add what its base never ran), as the project's components (MLP, ResNet18,
ToyNet) do; and a module whose ``forward``, ``model_step``, ``criterion``, ``manual_backward`` and ``backward``
are the project's or Lightning's, or whose own class declares ``capture_safe = True``. Elsewhere ``auto``
stays eager and says why in one info line; ``true`` refuses the run in one line (docs/subclassing.md).
A capture that fails all the same (an exception while recording) falls back to the eager step with one
warning: that step runs eagerly, once, and so does the rest of the fit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch
from lightning import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch import Tensor

from src.engine.steps.optimizers import is_fused
from src.engine.utils import lightning_compat as compat
from src.engine.utils.pylogger import RankedLogger

if TYPE_CHECKING:
    from src.engine.steps.step_output import StepOutput

log = RankedLogger(__name__)

WARMUP_STEPS = 3  # eager steps before capture (torch's whole-network example warms up for 3)

# The module's methods that run inside a capture (model_step calls forward and criterion; manual_backward, backward)
IN_CAPTURE_METHODS = ("forward", "model_step", "criterion", "manual_backward", "backward")

# Hooks Lightning runs *inside* an owned step (from manual_backward and optimizer.step): a capture runs them
# once, and a replay never, so a callback or module that overrides one keeps the step eager.
IN_STEP_HOOKS = ("on_before_backward", "on_after_backward", "on_before_optimizer_step", "on_before_zero_grad")


class StepGraph(Protocol):
    """What the capture needs of a graph: ``torch.cuda.CUDAGraph``'s two calls (tests use a CPU stand-in)."""

    def capture(self) -> contextlib.AbstractContextManager: ...

    def replay(self) -> None: ...


class CudaStepGraph:
    """``torch.cuda.CUDAGraph`` with its capture context."""

    def __init__(self) -> None:
        self.graph = torch.cuda.CUDAGraph()

    def capture(self) -> contextlib.AbstractContextManager:
        return torch.cuda.graph(self.graph)

    def replay(self) -> None:
        self.graph.replay()


# The graph kind per device type; a device type missing here cannot capture
GRAPHS: dict[str, Callable[[], StepGraph]] = {"cuda": CudaStepGraph}


def overrides(obj: object, base: type, name: str) -> bool:
    """Whether ``obj.name`` is not ``base``'s: a subclass's method, or one set on the instance (as
    ``LambdaCallback`` sets its hooks), which Lightning calls as it finds it."""
    found = getattr(obj, name, None)
    return getattr(found, "__func__", found) is not getattr(base, name, None)


def capture_blocker(trainer: Trainer, module: LightningModule, mode: str | bool) -> str | None:
    """Why this run's owned step stays eager under ``step_capture=mode`` (None: it is captured)."""
    if mode is False:
        return "model.step_capture=false"
    strategy = trainer.strategy
    device = strategy.root_device.type
    if device not in GRAPHS:
        return f"capture needs a CUDA device; this run trains on {device}"
    if not isinstance(strategy, SingleDeviceStrategy):
        return (f"{type(strategy).__name__}: capture runs on one device (DDP's NCCL capture has not run on "
                "several GPUs yet)")
    if module.automatic_optimization:
        return "the training step is Lightning's, not the module's (see model.owned_step)"
    if trainer.precision == "16-mixed":
        return "16-mixed scales the loss with a host-side check every step; bf16-mixed captures"
    if module.hparams.get("compile"):
        return "model.compile=true: torch.compile runs the net (compile_mode=reduce-overhead graphs it instead)"
    optimizers = trainer.optimizers
    if len(optimizers) != 1 or not is_fused(optimizers[0]):
        return "the optimizer is not one fused Adam/AdamW/SGD (model.fused_optimizer=true)"
    listener = in_step_hook_listener(trainer, module)
    if listener is not None:
        return f"{listener} runs inside the step, and a replay would skip it"
    return undeclared_capture_code(module)


def declares_capture_safe(cls: type) -> bool:
    """Whether ``cls``'s own body says ``capture_safe = True`` (inherited declarations do not count)."""
    return cls.__dict__.get("capture_safe") is True


def undeclared_capture_code(module: LightningModule) -> str | None:
    """What would run inside the capture without being known to be graph-safe (None: all of it is known)."""
    cls = type(module)
    if cls.__dict__.get("capture_safe") is not False:  # an explicit False opts the module out
        for name in IN_CAPTURE_METHODS:
            definer = next((k for k in cls.__mro__ if name in k.__dict__), None)
            if definer is None or definer is LightningModule or declares_capture_safe(definer) or \
                    declares_capture_safe(cls):
                continue
            return (f"{definer.__qualname__}.{name} runs inside the captured step and {cls.__qualname__} does not "
                    f"declare capture_safe = True (opt in where it makes no host sync, Python-side random draw or "
                    "data-dependent branch: docs/subclassing.md)")
    else:
        return f"{cls.__qualname__} declares capture_safe = False"
    net = getattr(module, "net", None)
    if net is not None and not declares_capture_safe(type(net)):
        return (f"model.net is {type(net).__qualname__}, which does not declare capture_safe = True (opt in, in its "
                "class body, where its forward makes no host sync, Python-side random draw or data-dependent "
                "branch: docs/subclassing.md)")
    return None


def in_step_hook_listener(trainer: Trainer, module: LightningModule) -> str | None:
    """``Class.hook`` of the first module or callback that overrides one of :data:`IN_STEP_HOOKS` (None: none)."""
    for obj, base in ((module, LightningModule), *((cb, Callback) for cb in trainer.callbacks)):
        hook = next((h for h in IN_STEP_HOOKS if overrides(obj, base, h)), None)
        if hook is not None:
            return f"{type(obj).__name__}.{hook}"
    return None


@contextlib.contextmanager
def autocast_without_cache(device_type: str) -> Iterator[None]:
    """The autocast in force, with its cast cache off (torch's CUDA-graph notes: a cached cast made outside a
    capture would be read stale by every replay)."""
    if not torch.is_autocast_enabled(device_type):
        yield
        return
    with torch.autocast(device_type, dtype=torch.get_autocast_dtype(device_type), cache_enabled=False):
        yield


@contextlib.contextmanager
def capturable(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Mark the optimizer's groups capturable for the capture only: torch's fused steps are graph-safe either
    way, and a capturable group stepped eagerly warns (and its state would save as capturable)."""
    saved = [group.get("capturable") for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        if "capturable" in group:
            group["capturable"] = True
    try:
        yield
    finally:
        for group, value in zip(optimizer.param_groups, saved, strict=True):
            if value is not None:
                group["capturable"] = value


def learning_rates_on_device(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Hold each group's learning rate as a device tensor, which schedulers fill in place (torch's
    ``_update_param_group_val``), so a replay reads the current value. torch's fused CUDA kernels read it as
    float32 (the eager step's float is a double: the last bits of an update may differ); on a CPU, float64."""
    dtype = torch.float32 if device.type == "cuda" else torch.float64
    for group in optimizer.param_groups:
        if not isinstance(group["lr"], Tensor):
            group["lr"] = torch.tensor(group["lr"], dtype=dtype, device=device)


def group_settings(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each param group's settings (all but its parameters): what a capture reads when it records the step."""
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def same_settings(a: Any, b: Any) -> bool:
    """Whether a replay still does what the capture recorded: values equal, tensors (read by the replay, so
    filled in place) the very same objects."""
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return a is b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_settings(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_settings(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def learning_rates_as_floats(checkpoint: dict) -> None:
    """A checkpoint keeps learning rates as floats, as an eager run holds them: it loads in either mode."""
    for state in checkpoint.get("optimizer_states", []):
        for group in state.get("param_groups", []):
            if isinstance(group.get("lr"), Tensor):
                group["lr"] = group["lr"].item()
    for state in checkpoint.get("lr_schedulers", []):  # a scheduler's last learning rates, one per group
        for key, value in state.items():
            if isinstance(value, list) and any(isinstance(lr, Tensor) for lr in value):
                state[key] = [lr.item() if isinstance(lr, Tensor) else lr for lr in value]


class StepCapture:
    """One fit's captured step for ``module`` (an owned-step :class:`~src.engine.steps.step_module.StepModule`)."""

    def __init__(self, module: Any, graph_kind: Callable[[], StepGraph], lr_on_device: bool) -> None:
        self.module = module
        self.graph_kind = graph_kind
        self.lr_on_device = lr_on_device
        self.warmup_left = WARMUP_STEPS
        self.graph: StepGraph | None = None
        self.static_batch: tuple[Tensor, ...] | None = None
        self.static_out: StepOutput | None = None
        self.captured_settings: list[dict[str, Any]] = []  # each param group's settings at capture
        self.said: set[str] = set()
        self.captures = self.replayed = 0
        self.side_stream = torch.cuda.Stream() if module.device.type == "cuda" else None

    # -- eager steps -------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def eager_step(self) -> Iterator[None]:
        """Around an eager step: counts the warm-up, and runs warm-up steps on a side stream."""
        self.warmup_left -= 1
        if self.side_stream is None or self.graph is not None:
            yield
            return
        current = torch.cuda.current_stream()
        self.side_stream.wait_stream(current)
        with torch.cuda.stream(self.side_stream):
            yield
        current.wait_stream(self.side_stream)

    def can_replay(self, batch: Any) -> bool:
        """Whether this batch runs as a replay (warm-up done, and the batch fits the captured buffers)."""
        if self.warmup_left > 0:
            return False
        why = self.eager_because(batch)
        if why is not None and why not in self.said:
            self.said.add(why)
            log.info(f"an eager step in the captured run: {why}")
        return why is None

    def eager_because(self, batch: Any) -> str | None:
        if not (isinstance(batch, (tuple, list)) and all(isinstance(t, Tensor) for t in batch)):
            return "the batch is not a tuple of tensors"
        if self.static_batch is None:
            return None
        if len(batch) != len(self.static_batch) or any(
                s.shape != t.shape or s.dtype != t.dtype for s, t in zip(self.static_batch, batch, strict=False)):
            return f"a batch of shape {tuple(batch[0].shape)} differs from the captured one (a ragged last batch)"
        return None

    # -- the captured step -------------------------------------------------------------------------------
    def step(self, batch: tuple[Tensor, ...]) -> StepOutput | None:
        """Run this batch's step as a replay (capturing first where needed): returns the step's outputs, or None
        where the capture failed (said in one warning): nothing of this step ran, and the caller runs it eagerly."""
        optimizer = self.module.optimizers()
        if self.static_batch is None:
            self.static_batch = tuple(t.clone() for t in batch)
        else:
            for static, t in zip(self.static_batch, batch, strict=True):
                static.copy_(t)
        if self.graph is None or not same_settings(group_settings(optimizer.optimizer), self.captured_settings):
            if not self.try_capture(optimizer):  # counts this step, through Lightning's optimizer.step
                return None
            self.graph.replay()
        else:
            with compat.counted_manual_step(self.module.trainer):
                self.graph.replay()
        self.replayed += 1
        return self.static_out

    def try_capture(self, optimizer: Any) -> bool:
        """Capture the step; where that raises, put back what the attempt changed outside the graph (learning rates
        made device tensors, Lightning's step count and profiler entry), say so once, and return False."""
        lrs = [group["lr"] for group in optimizer.optimizer.param_groups]
        progress = self.module.trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress
        counted = progress.state_dict()
        try:
            self.capture(optimizer)
        except Exception as error:  # noqa: BLE001 - any failure to record falls back to the eager step
            self.graph = self.static_out = None
            for group, lr in zip(optimizer.optimizer.param_groups, lrs, strict=True):
                group["lr"] = float(group["lr"]) if not isinstance(lr, Tensor) else lr
            if progress.total.ready != counted["total"]["ready"]:  # failed inside Lightning's optimizer.step
                if progress.total.completed == counted["total"]["completed"]:
                    self.module.trainer.profiler.stop("optimizer_step")
                progress.load_state_dict(counted)
            what = (str(error).strip().splitlines() or [""])[0][:200]
            log.warning(f"the training step could not be captured ({type(error).__name__}: {what}); it runs eagerly "
                        f"from here, with the eager step's numbers (declare capture_safe = True only on code that "
                        "makes no host sync; or set model.step_capture=false)")
            return False
        self.captures += 1
        return True

    def capture(self, optimizer: Any) -> None:
        module = self.module
        if self.lr_on_device:
            learning_rates_on_device(optimizer.optimizer, module.device)
        optimizer.zero_grad(set_to_none=True)  # gradients are then allocated in the graph's pool
        self.graph = self.graph_kind()
        with capturable(optimizer.optimizer), self.graph.capture(), autocast_without_cache(module.device.type):
            out = module.model_step(self.static_batch)
            module.manual_backward(out["loss"])
            optimizer.step()
        self.static_out = out
        self.captured_settings = group_settings(optimizer.optimizer)
