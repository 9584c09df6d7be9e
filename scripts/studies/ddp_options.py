"""DDP options a plain script leaves at their defaults, measured on bare torch DDP (no Lightning):

    python -m scripts.studies.ddp_options                 # 2 gloo ranks on this machine, 9 rounds
    python -m scripts.studies.ddp_options --rounds 5 --steps 200

Each rank trains the Fashion-MNIST MLP (784-512-256-10, dropout 0.1) on a fixed batch of 64 (global
128) with fused Adam and one torch thread. Every round builds a fresh DDP model for each setting in turn
and times ``steps`` steps after 10 warm-up steps. The report gives, per setting, the median ms/step and
the median (min-max) of its same-round speedup over torch's defaults. The settings are
``gradient_as_bucket_view``, ``static_graph`` and ``bucket_cap_mb``. On CUDA devices
(``--backend nccl``, one GPU per rank) the same script measures the GPU case.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from src.models.components.mlp import MLP

SETTINGS: dict[str, dict] = {
    "torch defaults": {},
    "gradient_as_bucket_view": {"gradient_as_bucket_view": True},
    "static_graph": {"static_graph": True},
    "bucket_cap_mb=1": {"bucket_cap_mb": 1},
    "all three": {"gradient_as_bucket_view": True, "static_graph": True, "bucket_cap_mb": 1},
}


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return MLP()  # the project's Fashion-MNIST MLP, its defaults: 784-512-256-10, dropout 0.1


def worker(rank: int, world: int, backend: str, port: int, rounds: int, steps: int, queue) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=world)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    x, y = torch.randn(64, 1, 28, 28, device=device), torch.randint(0, 10, (64,), device=device)
    times: dict[str, list[float]] = {name: [] for name in SETTINGS}
    for _ in range(rounds):
        for name, options in SETTINGS.items():
            model = nn.parallel.DistributedDataParallel(mlp().to(device), **options)
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
            for i in range(steps + 10):
                if i == 10:
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    dist.barrier()
                    start = time.perf_counter()
                optimizer.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[name].append((time.perf_counter() - start) / steps * 1e3)
    if rank == 0:
        queue.put(times)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--port", type=int, default=29533)
    args = parser.parse_args()
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(worker, args=(args.nproc, args.backend, args.port, args.rounds, args.steps, queue), nprocs=args.nproc)
    times = queue.get()
    base = times["torch defaults"]
    print(f"| setting ({args.nproc} {args.backend} ranks, {args.rounds} rounds) | ms/step | speedup vs defaults |")
    print("|---|---|---|")
    for name, values in times.items():
        ratios = [b / v for b, v in zip(base, values, strict=True)]
        print(f"| {name} | {statistics.median(values):.2f} | {statistics.median(ratios):.3f}x "
              f"({min(ratios):.3f}-{max(ratios):.3f}x) |")


if __name__ == "__main__":
    main()
