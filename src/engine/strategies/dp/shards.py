"""The four moves of single-process data parallelism: scatter, replicate, parallel apply, gather.

``torch.nn.parallel`` has all four, but only ``replicate`` is usable as is, and only on CUDA:
``scatter``/``gather`` and ``parallel_apply`` refuse CPU devices, ``parallel_apply`` can only call
``forward`` (the ``dp`` strategy calls ``model_step``), and ``gather`` cannot weight per-shard
losses. So the other three are written here, device-agnostic, mirroring torch's behaviour:
shards are as even as possible, worker threads inherit the caller's grad/inference/autocast
modes and CUDA device/stream, and a failing shard re-raises its own exception.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor, nn

from src.engine.utils import lightning_compat as compat

# -- scatter ----------------------------------------------------------------------


def batch_size_of(batch: Any) -> int:
    """Number of samples in ``batch``: the common leading size of its tensors."""
    sizes: set[int] = set()
    apply_to_collection(batch, Tensor, lambda t: sizes.add(t.shape[0]) if t.dim() > 0 else None)
    if len(sizes) != 1:
        raise ValueError(
            f"dp splits a batch along dim 0 of its tensors, which need one common size; found sizes {sorted(sizes)}"
        )
    return sizes.pop()


def shard_sizes(batch_size: int, num_shards: int) -> list[int]:
    """Split ``batch_size`` into ``num_shards`` sizes differing by at most one, larger first (as ``tensor_split``)."""
    base, extra = divmod(batch_size, num_shards)
    return [base + 1 if i < extra else base for i in range(num_shards)]


def split_batch(batch: Any, sizes: Sequence[int]) -> list[Any]:
    """Cut every tensor of ``batch`` into consecutive dim-0 views of ``sizes``; other leaves are shared."""
    shards, start = [], 0
    for size in sizes:
        shards.append(apply_to_collection(batch, Tensor, lambda t, s=start, n=size: t.narrow(0, s, n)))
        start += size
    return shards


# -- replicate --------------------------------------------------------------------


def make_replicas(module: nn.Module, devices: Sequence[torch.device]) -> list[nn.Module]:
    """One replica of ``module`` per device, for one step.

    CUDA: ``torch.nn.parallel.replicate`` (parameters broadcast with autograd, so gradients are
    summed back into the root's parameters). CPU: the root itself for shard 0 and replicas
    sharing its parameter tensors for the others.
    """
    if devices[0].type == "cuda":
        replicas = nn.parallel.replicate(module, list(devices), detach=not torch.is_grad_enabled())
        for replica, device in zip(replicas, devices, strict=True):
            compat.point_replica_at(replica, device)
        return replicas
    return [module] + [compat.replica_sharing_parameters(module) for _ in devices[1:]]


# -- parallel apply ---------------------------------------------------------------


@dataclass(frozen=True)
class ThreadModes:
    """Thread-local torch modes of the calling thread, to re-enter in worker threads."""

    grad_enabled: bool
    inference_mode: bool
    device_type: str
    autocast_enabled: bool
    autocast_dtype: torch.dtype

    @classmethod
    def capture(cls, device_type: str) -> ThreadModes:
        return cls(
            grad_enabled=torch.is_grad_enabled(),
            inference_mode=torch.is_inference_mode_enabled(),
            device_type=device_type,
            autocast_enabled=torch.is_autocast_enabled(device_type),
            autocast_dtype=torch.get_autocast_dtype(device_type),
        )

    @contextmanager
    def enter(self) -> Iterator[None]:
        with (
            torch.inference_mode(self.inference_mode),
            torch.set_grad_enabled(self.grad_enabled),
            torch.autocast(self.device_type, dtype=self.autocast_dtype, enabled=self.autocast_enabled),
        ):
            yield


@contextmanager
def on_device(device: torch.device, stream: torch.cuda.Stream | None) -> Iterator[None]:
    """Make ``device`` (and the caller's stream on it) current in this thread; nothing to do on CPU."""
    with ExitStack() as stack:
        if device.type == "cuda":
            stack.enter_context(torch.cuda.device(device))
            stack.enter_context(torch.cuda.stream(stream))
        yield


class ShardRunner:
    """Calls a function once per shard in parallel: shard 0 on the calling thread, the rest on worker threads.

    A persistent pool avoids starting threads on every step. Autograd graphs built in the
    workers are ordinary graphs: one ``backward()`` on the main thread traverses them all.
    """

    def __init__(self, num_shards: int) -> None:
        workers = max(num_shards - 1, 1)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dp-shard")

    def run(
        self, fn: Callable[..., Any], shard_args: Sequence[tuple], devices: Sequence[torch.device]
    ) -> list[Any]:
        modes = ThreadModes.capture(devices[0].type)
        streams = [torch.cuda.current_stream(d) if d.type == "cuda" else None for d in devices]

        def call(i: int) -> Any:
            with modes.enter(), on_device(devices[i], streams[i]):
                return fn(*shard_args[i])

        futures = [self._pool.submit(call, i) for i in range(1, len(shard_args))]
        try:
            first = call(0)
        finally:
            wait(futures)  # never leave a shard running past its step, even when shard 0 failed
        return [first] + [f.result() for f in futures]  # result() re-raises a worker's exception

    def close(self) -> None:
        self._pool.shutdown(wait=True)


# -- gather -----------------------------------------------------------------------


def gather_step_outputs(
    outputs: Sequence[Mapping[str, Any]], sizes: Sequence[int], device: torch.device
) -> dict:
    """Merge per-shard step outputs on ``device``, differentiably.

    ``loss`` (a per-shard mean) becomes the shard-size-weighted mean, which is exactly the mean
    over the whole batch even for uneven shards; every other entry holds one row per sample
    and is concatenated in shard order.
    """
    keys = list(outputs[0])
    if any(list(out) != keys for out in outputs):
        raise ValueError(
            f"model_step returned different keys on different shards: {[list(o) for o in outputs]}"
        )
    gathered: dict[str, Tensor] = {}
    for key in keys:
        values = [out[key] for out in outputs]
        if not all(isinstance(v, Tensor) for v in values):
            raise TypeError(
                f"dp can only gather tensors from model_step; {key!r} is {type(values[0]).__name__}"
            )
        if key == "loss":
            if any(v.dim() != 0 for v in values):
                raise ValueError("model_step must return the mean loss of its shard as a scalar tensor")
            losses = torch.stack([v.to(device) for v in values])
            weights = torch.tensor(sizes, dtype=losses.dtype, device=device) / sum(sizes)
            gathered[key] = (losses * weights).sum()
        else:
            gathered[key] = torch.cat([v.to(device) for v in values])
    return gathered
