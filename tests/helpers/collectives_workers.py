"""Worker functions for ``tests/test_collectives.py``, run on spawned gloo ranks by ``run_workers``.

They live apart from the tests so spawned ranks import only torch and the collectives package, not
Lightning (about 2.5 s of start-up per rank on this machine). No tests are collected from here.
"""

from __future__ import annotations

import itertools
import time
import warnings

import torch
import torch.distributed as dist

from src.collectives.benchmark import benchmark_sweep
from src.collectives.checks import Check, run_checks
from src.collectives.report import save_benchmark
from src.collectives.ring import compare_with_all_reduce, ring_all_reduce
from src.collectives.runtime import CollectiveError, CollectiveTimeoutError
from src.collectives.suite import run_suite
from src.collectives.sync_sgd import compare_with_ddp


def faulty_all_reduce(ctx):
    """An injected faulty op: the last rank corrupts its all_reduce result."""
    t = torch.full((3,), float(ctx.rank + 1), device=ctx.device)
    ctx.wait(dist.all_reduce(t, async_op=True))
    if ctx.rank == ctx.world_size - 1:
        t += 1
    n = ctx.world_size
    return torch.full((3,), n * (n + 1) / 2), t


_RUNS = itertools.count()


def faulty_from_third_run(ctx):
    """Correct on its first two runs in a process, then the last rank corrupts its all_reduce result."""
    return faulty_all_reduce(ctx) if next(_RUNS) >= 2 else _honest_all_reduce(ctx)


def _honest_all_reduce(ctx):
    t = torch.full((3,), float(ctx.rank + 1), device=ctx.device)
    ctx.wait(dist.all_reduce(t, async_op=True))
    n = ctx.world_size
    return torch.full((3,), n * (n + 1) / 2), t


def ring_cases(n: int) -> list[dict]:
    numels = [0, 1, n - 1, 7, 1000, 2**20 + 3]
    rows = compare_with_all_reduce(numels)
    for op in (dist.ReduceOp.MAX, dist.ReduceOp.MIN):
        rows += [{**r, "op": str(op)} for r in compare_with_all_reduce([0, 5, 1000], op=op)]
    # the stepwise schedule, tiny segments (many per chunk), and a non-contiguous input
    x = torch.arange(3000, dtype=torch.float64).reshape(60, 50).t() * (dist.get_rank() + 1)
    y = x.clone()
    ring_all_reduce(x, segment_bytes=64)
    dist.all_reduce(y)
    z = torch.arange(1001, dtype=torch.int64) * (dist.get_rank() + 1)
    zz = z.clone()
    ring_all_reduce(z, pipelined=False)
    dist.all_reduce(zz)
    rows.append({"numel": 3000, "dtype": "non-contiguous/segments", "equal": torch.equal(x, y)})
    rows.append({"numel": 1001, "dtype": "stepwise", "equal": torch.equal(z, zz)})
    return rows


def many_checks(rank: int, world_size: int, out_dir: str) -> dict:
    """One spawn, everything: suite, ring, sync SGD, a faulty op, a small benchmark, a timeout."""
    out: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = run_suite(timeout_s=30)
    out["results"] = [(r.op, r.status, r.reason) for r in report.results]
    out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning | FutureWarning)]
    out["ring"] = ring_cases(world_size)
    out["sgd"] = compare_with_ddp(steps=3, batch_size=8)

    faulty = Check("all_reduce.faulty", faulty_all_reduce)
    bad = run_checks(checks=[], extra_checks=[faulty], timeout_s=30)
    try:
        bad.raise_if_failed()
    except CollectiveError as err:
        out["faulty_message"] = str(err)

    rows, skipped = benchmark_sweep(["4KB", "64KB"], warmup=1, iters=2)
    out["bench_skipped"] = skipped
    if rank == 0:
        save_benchmark(rows, out_dir, skipped)

    # last, as it leaves the group unusable: rank 0 waits for an all_reduce that rank 1 never joins
    timeout_check = Check("all_reduce.missing_rank", all_reduce_without_last_rank)
    start = time.monotonic()
    try:
        run_checks(checks=[], extra_checks=[timeout_check], timeout_s=1.0, gather=False)
    except CollectiveTimeoutError as err:
        out["timeout_message"] = str(err)
    out["timeout_seconds"] = time.monotonic() - start
    return out


def all_reduce_without_last_rank(ctx):
    if ctx.rank == ctx.world_size - 1:
        time.sleep(2)  # stay alive so the others see a timeout, not a closed connection
        return None
    t = torch.ones(2)
    ctx.wait(dist.all_reduce(t, async_op=True))
    return t, t


def nccl_suite(rank: int, world_size: int, port: int) -> list[tuple[str, str, str]]:
    """Swap the helper's gloo group for an nccl one (tensors on cuda:rank) and run the suite."""
    torch.cuda.set_device(rank)
    dist.destroy_process_group()
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    report = run_suite(timeout_s=60)
    x = torch.arange(1 << 20, dtype=torch.float32, device=f"cuda:{rank}") * (rank + 1)
    y = x.clone()
    ring_all_reduce(x)
    dist.all_reduce(y)
    return [(r.op, r.status, r.reason) for r in report.results] + [("ring", str(torch.equal(x, y)), "")]
