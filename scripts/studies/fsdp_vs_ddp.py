"""FSDP2 (the project's block sharding) against DDP, bare torch on gloo ranks: step time and memory per rank.

    python -m scripts.studies.fsdp_vs_ddp                       # 2 ranks, the MLP and a wide MLP, 3 rounds
    python -m scripts.studies.fsdp_vs_ddp --nproc 4 --rounds 1 --hidden 4096,4096
    python -m scripts.studies.fsdp_vs_ddp --malloc glibc         # glibc's own allocator settings

Each rank trains an MLP of the project (``src/models/components/mlp.py``, dropout 0.1) on a fixed batch of
64 (global 64 x ranks) with fused Adam and one torch thread. FSDP shards it with the strategy's own
``shard_by_blocks`` (``sharding_strategy=full``). Every measurement starts fresh processes, warms up (5
steps) and times ``steps`` steps; contenders alternate which goes first.

Per contender the table gives the median ms/step (the slowest rank of each round) with the median (min-max)
of its same-round ratio to DDP, the bytes one rank holds for parameters, gradients and Adam state (measured
on the local tensors: ``DTensor.to_local()`` for shards), and the rank's peak RSS during the timed steps
(``VmHWM``, reset through ``/proc/self/clear_refs`` on Linux after ``malloc_trim``: the whole process,
interpreter and libraries included) and, in brackets, that peak above the rank's RSS before the model was built.
By default glibc hands freed memory back at once (``--malloc prompt``), so RSS follows the live tensors:
with its own settings, the buffers FSDP gathers and frees every block may stay in per-thread arenas.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import re
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.tensor import DTensor

from src.models.components.mlp import MLP

CONTENDERS = ("ddp", "fsdp")


class Holder(nn.Module):
    """What the strategy shards: a module with ``net``, an ``nn.Sequential`` of named blocks."""

    def __init__(self, hidden: list[int]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = MLP(hidden_sizes=hidden)


def rss_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        return int(re.search(rf"{field}:\s+(\d+)", status.read()).group(1))


def reset_peak_rss() -> None:
    """Give freed heap back to the OS (the full model FSDP sharded, warm-up garbage), then VmHWM := VmRSS."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux: VmHWM := VmRSS
    except OSError:
        pass


def held_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    tensors = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None),
               *(v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))]
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local)


def build(contender: str, hidden: list[int], world: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from src.engine.strategies.fsdp.wrap import shard_by_blocks

    holder = Holder(hidden)
    if contender == "ddp":
        return nn.parallel.DistributedDataParallel(holder.net)
    shard_by_blocks(holder, init_device_mesh("cpu", (world,)), True, MixedPrecisionPolicy(), False)
    return holder.net


def run_one(contender: str, hidden: list[int], world: int, steps: int) -> tuple[float, int, int, int]:
    """``(ms/step, held bytes, peak RSS during the timed steps, RSS before the model)`` of this rank, in bytes."""
    x, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
    before = rss_kib("VmRSS") * 1024
    model = build(contender, hidden, world)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    for i in range(steps + 5):
        if i == 5:
            reset_peak_rss()
            dist.barrier()
            start = time.perf_counter()
        optimizer.zero_grad(set_to_none=False)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    dist.barrier()
    ms = (time.perf_counter() - start) / steps * 1e3
    return ms, held_bytes(model, optimizer), rss_kib("VmHWM") * 1024, before


def worker(rank: int, world: int, port: int, contender: str, hidden: list[int], steps: int, queue) -> None:
    """One measurement in fresh processes: the peak RSS is this contender's alone."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result = run_one(contender, hidden, world, steps)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, result)
    if rank == 0:
        queue.put(everyone)  # a SimpleQueue writes at once: nothing is left to flush
    dist.barrier()
    os._exit(0)  # no interpreter teardown: gloo's threads may abort it (docs/faults.md), and the OS frees the rest


def measure(contender: str, hidden: list[int], world: int, steps: int, port: int) -> list[tuple]:
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(worker, args=(world, port, contender, hidden, steps, queue), nprocs=world)
    return queue.get()


def table(results: dict[tuple[str, str], list[list[tuple]]], workloads: dict[str, list[int]], world: int,
          rounds: int) -> str:
    lines = [f"| workload ({world} gloo ranks, {rounds} rounds) | strategy | ms/step | vs DDP | "
             "params+grads+Adam per rank | peak RSS per rank (above start) |", "|---|---|---|---|---|---|"]
    for workload in workloads:
        # per round: the slowest rank's time, the largest rank's bytes
        slowest = {c: [max(r[0] for r in ranks) for ranks in results[(workload, c)]] for c in CONTENDERS}
        for contender in CONTENDERS:
            runs = results[(workload, contender)]
            ratios = [s / d for s, d in zip(slowest[contender], slowest["ddp"], strict=True)]
            held = max(r[1] for r in runs[-1])
            peak = statistics.median(max(r[2] for r in ranks) for ranks in runs)
            above = statistics.median(max(r[2] - r[3] for r in ranks) for ranks in runs)
            lines.append(f"| {workload} | {contender} | {statistics.median(slowest[contender]):.1f} | "
                         f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) | "
                         f"{held / 2**20:.1f} MiB | {peak / 2**20:.0f} MiB ({above / 2**20:.0f} MiB) |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--hidden", default="2048,2048,2048,2048,2048,2048", help="hidden sizes of the wide MLP")
    parser.add_argument("--port", type=int, default=29541)
    parser.add_argument("--malloc", choices=("prompt", "glibc"), default="prompt",
                        help="prompt: glibc hands freed tensors back to the OS at once, so RSS follows the live "
                             "tensors; glibc: its defaults, where freed buffers may stay in per-thread arenas")
    args = parser.parse_args()
    if args.malloc == "prompt":  # read by glibc when each rank's process starts (spawn)
        os.environ.update(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_ARENA_MAX="2")
    wide = [int(h) for h in args.hidden.split(",")]
    name = f"{wide[0]}x{len(wide)}" if len(set(wide)) == 1 else "-".join(map(str, wide))
    workloads = {"MLP 784-512-256-10": [512, 256], f"MLP 784-{name}-10": wide}
    results: dict[tuple[str, str], list[list[tuple]]] = {}
    for round_ in range(args.rounds):
        for workload, hidden in workloads.items():
            for contender in CONTENDERS[::1 if round_ % 2 == 0 else -1]:  # alternate which goes first
                ranks = measure(contender, hidden, args.nproc, args.steps, args.port)
                results.setdefault((workload, contender), []).append(ranks)
    print(table(results, workloads, args.nproc, args.rounds) + f"\n\nmalloc: {args.malloc}")


if __name__ == "__main__":
    main()
