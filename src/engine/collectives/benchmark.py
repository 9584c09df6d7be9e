"""Latency and bandwidth of the collectives over a sweep of message sizes, with the nccl-tests conventions.

For a message of ``S`` bytes taking ``t`` seconds: ``algbw = S / t`` and ``busbw = algbw * factor`` with
the nccl-tests factors (all_reduce ``2(n-1)/n``; all_gather, reduce_scatter, all_to_all ``(n-1)/n``;
broadcast, reduce ``1``), so busbw is comparable with the link (here: memory/loopback) bandwidth whatever
the rank count. ``S`` is the full buffer: the all_reduce tensor, the all_gather *output*, the
reduce_scatter *input*, the all_to_all buffer. ``memcpy`` (``Tensor.copy_`` of ``S`` bytes on every rank
at once, on the group's device) is the ceiling on a CPU, where gloo's loopback transfers are memory
copies too. On a GPU it is a copy inside one GPU, faster than any link between GPUs: a reference only,
and labelled so (``BenchRow.device``).

Iterations of all ops are interleaved (op A, op B, ... then again, in rotating order), so slow phases of a
shared machine hit every op alike; each iteration's time is the slowest rank's, and the median over
iterations is reported.
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from src.engine.collectives.checks import is_unsupported
from src.engine.collectives.ring import ring_all_reduce
from src.engine.collectives.runtime import (
    all_gather_tensor,
    backend_name,
    comm_device,
    reduce_scatter_tensor,
    synchronize,
)

DEFAULT_OPS = ("all_reduce", "ring_all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast",
               "reduce")
MEMCPY = "memcpy"


def busbw_factor(op: str, n: int) -> float:
    """nccl-tests bus-bandwidth factor for ``op`` on ``n`` ranks."""
    if op in ("all_reduce", "ring_all_reduce"):
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op in ("broadcast", "reduce", MEMCPY):
        return 1.0
    raise ValueError(f"unknown benchmark op {op!r}; known: {', '.join((*DEFAULT_OPS, MEMCPY))}")


_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or text like ``"64KB"``, ``"16M"``, ``"1GiB"`` (binary units)."""
    if isinstance(size, int):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(size))
        if not match or match.group(2).upper() not in _UNITS:
            raise ValueError(f"bad message size {size!r}: use bytes or e.g. 1KB, 16MB, 1GB")
        value = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    if value <= 0:
        raise ValueError(f"message size must be positive, got {size!r}")
    return value


def format_size(nbytes: int) -> str:
    """``1024 -> "1KB"``, ``1048572 -> "1MB"`` (sizes rounded down to a multiple of the rank count keep their
    nominal label), ``1536 -> "1.5KB"``."""
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= 0.99 * scale:
            value = nbytes / scale
            return f"{round(value)}{unit}" if abs(value - round(value)) < 0.01 * value else f"{value:.3g}{unit}"
    return f"{nbytes}B"


def size_sweep(min_size: int | str = "1KB", max_size: int | str = "64MB", factor: int = 4) -> list[int]:
    """``min_size, min_size * factor, ...`` up to ``max_size`` inclusive."""
    lo, hi = parse_size(min_size), parse_size(max_size)
    if factor < 2 or lo > hi:
        raise ValueError(f"bad sweep: min {min_size}, max {max_size}, factor {factor}")
    sizes = [lo]
    while sizes[-1] * factor <= hi:
        sizes.append(sizes[-1] * factor)
    return sizes


@dataclass
class BenchRow:
    """One (op, size) measurement."""

    op: str
    size_bytes: int
    world_size: int
    backend: str
    dtype: str
    iters: int
    latency_us: float
    algbw_GBps: float  # noqa: N815 - unit in the name, as printed
    busbw_GBps: float  # noqa: N815
    device: str = "cpu"  # type of the device the buffers lived on: "cuda" makes memcpy an intra-GPU copy

    def as_dict(self) -> dict:
        return asdict(self)


def _make_op(op: str, a: torch.Tensor, b: torch.Tensor, n: int, group) -> Callable[[], object]:
    """A zero-argument call of ``op`` on the preallocated buffers (``a`` holds S bytes, ``b`` too)."""
    part = a.numel() // n
    calls: dict[str, Callable[[], object]] = {
        "all_reduce": lambda: dist.all_reduce(a, group=group),
        "ring_all_reduce": lambda: ring_all_reduce(a, group=group),
        "broadcast": lambda: dist.broadcast(a, src=0, group=group),
        "reduce": lambda: dist.reduce(a, dst=0, group=group),
        "all_gather": lambda: all_gather_tensor(b, a[:part], group=group),
        "reduce_scatter": lambda: reduce_scatter_tensor(b[:part], a, group=group),
        "all_to_all": lambda: dist.all_to_all_single(b, a, group=group),
        MEMCPY: lambda: b.copy_(a),
    }
    if op not in calls:
        raise ValueError(f"unknown benchmark op {op!r}; known: {sorted(calls)}")
    return calls[op]


def benchmark_sweep(
    sizes: Sequence[int | str] | None = None,
    ops: Sequence[str] = DEFAULT_OPS,
    warmup: int = 5,
    iters: int = 20,
    dtype: torch.dtype = torch.float32,
    memcpy: bool = True,
    group: dist.ProcessGroup | None = None,
) -> tuple[list[BenchRow], dict[str, str]]:
    """Time ``ops`` at each size on every rank of ``group`` (all ranks must call it with the same arguments).

    Returns the rows (identical on every rank) and ``{op: reason}`` for ops the backend could not run.
    Buffers are zero-filled so repeated reductions stay finite. Element counts are rounded down to a
    multiple of the world size so every rank's part is equal; ``size_bytes`` is the size actually moved.
    """
    sizes = [parse_size(s) for s in (sizes or size_sweep())]
    n, backend, device = dist.get_world_size(group), backend_name(group), comm_device(group)
    names = list(ops) + ([MEMCPY] if memcpy and MEMCPY not in ops else [])
    for name in names:
        busbw_factor(name, n)  # unknown op -> error before any communication
    elem = torch.empty((), dtype=dtype).element_size()
    rows: list[BenchRow] = []
    skipped: dict[str, str] = {}
    for size in sizes:
        numel = max(n, size // elem // n * n)
        a = torch.zeros(numel, dtype=dtype, device=device)
        b = torch.zeros(numel, dtype=dtype, device=device)
        calls = {}
        for name in names:
            if name in skipped:
                continue
            call = _make_op(name, a, b, n, group)
            try:
                for _ in range(max(1, warmup)):
                    call()
            except RuntimeError as err:
                if not is_unsupported(err):
                    raise
                skipped[name] = f"unsupported by {backend}: {str(err).splitlines()[0][:160]}"
                continue
            calls[name] = call
        times = _timed_interleaved(calls, iters, device, group)
        for name, median_s in times.items():
            nbytes = numel * elem
            algbw = nbytes / median_s / 1e9
            rows.append(BenchRow(name, nbytes, n, backend, str(dtype).removeprefix("torch."), iters,
                                 median_s * 1e6, algbw, algbw * busbw_factor(name, n), device.type))
        del a, b
    return rows, skipped


def _timed_interleaved(calls: dict[str, Callable[[], object]], iters: int, device: torch.device,
                       group) -> dict[str, float]:
    """Median over iterations of the slowest rank's time, per op. Ops take turns within each iteration, in an
    order rotated every iteration, so no op always inherits the same predecessor's cache and socket state."""
    names = list(calls)
    local = [[0.0] * max(1, iters) for _ in names]
    for it in range(max(1, iters)):
        for j in range(len(names)):
            k = (j + it) % len(names)
            dist.barrier(group=group)
            start = time.perf_counter()
            calls[names[k]]()
            synchronize(device)
            local[k][it] = time.perf_counter() - start
    # on the group's device: nccl has no CPU tensors (times are kept on the host until here)
    slowest = torch.tensor(local, dtype=torch.float64, device=device).reshape(len(names), max(1, iters))
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)  # per-iteration time = slowest rank
    return {name: statistics.median(slowest[k].tolist()) for k, name in enumerate(names)}


def ring_ratio(rows: Sequence[BenchRow], min_bytes: int = 16 << 20) -> dict[int, float]:
    """``{size: ring busbw / all_reduce busbw}`` for sizes of at least ``min_bytes`` (nominal: a size rounded
    down to a multiple of the rank count still counts)."""
    by = {(r.op, r.size_bytes): r.busbw_GBps for r in rows}
    return {size: by[("ring_all_reduce", size)] / by[("all_reduce", size)]
            for (op, size) in by if op == "all_reduce" and size >= 0.99 * min_bytes
            and ("ring_all_reduce", size) in by and by[("all_reduce", size)] > 0}
