"""What every collective helper needs from the running process group: device, backend, timed waits.

Timeouts: gloo's ``Work.wait(timeout)`` raises after the timeout; NCCL's does not block the host the
same way, so other backends poll ``Work.is_completed()`` against a deadline instead. Calls that have no
``async_op`` form (blocking send/recv, object collectives, ``new_group``) run on a watchdog thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from src.engine.runtime.launch_context import launch_context

T = TypeVar("T")


class CollectiveError(RuntimeError):
    """A collective returned a wrong result or raised; the message names op, ranks, expected and received."""


class CollectiveTimeoutError(CollectiveError):
    """A collective did not complete within its timeout (a rank is missing, stuck or deadlocked)."""


def is_distributed() -> bool:
    """True when a default process group exists in this process."""
    return dist.is_available() and dist.is_initialized()


def backend_name(group: dist.ProcessGroup | None = None) -> str:
    """``gloo``, ``nccl``, ``mpi``... for ``group`` (default: the world group)."""
    return str(dist.get_backend(group)).lower()


def cuda_index(local_rank: int, visible: int) -> int:
    """This process's GPU among the ``visible`` ones: ``local_rank % visible``.

    With every GPU of the node visible that is ``LOCAL_RANK``; when ``CUDA_VISIBLE_DEVICES`` (``srun
    --gpus-per-task``) shows each process only its own GPU, it is 0, since ``cuda:LOCAL_RANK`` would not exist.
    """
    if visible < 1:
        raise RuntimeError(f"no CUDA device is visible to local rank {local_rank} (check CUDA_VISIBLE_DEVICES)")
    return local_rank % visible


def comm_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Device that every tensor handed to this backend must live on: this rank's GPU for nccl, else cpu."""
    if "nccl" in backend_name(group):
        index = launch_context().local_rank
        if index is None:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cuda", cuda_index(index, torch.cuda.device_count()))
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so host timers and comparisons see finished results."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wait(work: Any, timeout_s: float, what: str, backend: str | None = None) -> None:
    """Wait for an async work handle; raise :class:`CollectiveTimeoutError` naming ``what`` after ``timeout_s``.

    ``backend`` defaults to the world group's (work handles do not say which backend made them).
    """
    if work is None:  # this rank is not a member of the group: nothing was launched
        return
    if backend is None:
        backend = backend_name() if is_distributed() else ""
    if "gloo" in backend:
        try:
            work.wait(timedelta(seconds=timeout_s))
        except RuntimeError as err:
            text = str(err).lower()
            if "timed out" in text or "timeout" in text:
                raise CollectiveTimeoutError(f"{what}: no completion within {timeout_s:g}s") from err
            raise CollectiveError(f"{what}: {first_line(err)}") from err  # e.g. a peer went away
        return
    deadline = time.monotonic() + timeout_s
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise CollectiveTimeoutError(f"{what}: no completion within {timeout_s:g}s")
        time.sleep(0.0005)
    try:
        work.wait()
    except RuntimeError as err:
        raise CollectiveError(f"{what}: {first_line(err)}") from err


def first_line(err: BaseException) -> str:
    """The first line of an error's message (its type name if empty), at most 200 characters."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:200]


def call_with_timeout(fn: Callable[[], T], timeout_s: float, what: str) -> T:
    """Run a blocking call on a daemon thread; raise :class:`CollectiveTimeoutError` if it outlives ``timeout_s``.

    A stuck call keeps its thread, but the caller stops waiting and can abort the run.
    """
    box: dict[str, Any] = {}
    # The current CUDA device is per thread: carry the caller's over (nccl object collectives use it).
    cuda_device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def target() -> None:
        if cuda_device is not None:
            torch.cuda.set_device(cuda_device)
        try:
            box["value"] = fn()
        except BaseException as err:  # handed back to the caller's thread
            box["error"] = err

    thread = threading.Thread(target=target, name=f"collective:{what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise CollectiveTimeoutError(f"{what}: no completion within {timeout_s:g}s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _first_available(*names: str) -> Callable[..., Any]:
    for name in names:
        fn = getattr(dist, name, None)
        if fn is not None:
            return fn
    raise AttributeError(f"torch.distributed has none of {names}")


# Tensor forms of all_gather / reduce_scatter: torch 2.14 names them *_single and deprecates the
# *_into_tensor / *_tensor names (FutureWarning); older torch only has the latter.
all_gather_tensor = _first_available("all_gather_single", "all_gather_into_tensor")
reduce_scatter_tensor = _first_available("reduce_scatter_single", "reduce_scatter_tensor")
