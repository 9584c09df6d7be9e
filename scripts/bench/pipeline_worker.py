"""Benchmark: pipeline throughput against the unsplit model, and efficiency against the ideal speedup.

    python -m scripts.bench.pipeline_worker --out benchmarks/pipeline          # Markdown table + results.json

For ``p`` stages and ``m`` micro-batches a pipeline is busy ``m`` of every ``m + p - 1`` slots
(the GPipe/1F1B bubble is ``(p - 1) / (m + p - 1)``), so its ideal speedup over one device is
``p * m / (m + p - 1)``. This script measures the real speedup of the project's pipeline step
(:class:`~src.engine.strategies.pipeline.runner.PipelineRunner`, as ``trainer=pipeline`` builds it: schedule
forward+backward, output broadcast, then each stage's optimizer step) over the same model unsplit
in one process, for each schedule (GPipe, and 1F1B, ``trainer=pipeline``'s default, where ``m >= p``).

Fairness:

* every process runs with ``torch.set_num_threads(1)``: the unsplit model gets one core, the
  pipeline one core per stage (this machine has 2 cores: p = 2);
* same model (identical weights), same global batch, same loss and optimizer (SGD), same
  number of steps;
* contenders alternate side by side in one run (unsplit, GPipe m=1, m=2, ..., 1F1B m=2, ... then
  again), each round timed between barriers; warm-up steps are excluded; the median round counts;
* a calibration measures how much parallel compute the processes actually get (the same matmuls
  on one process alone vs on all at once): on a machine whose "cores" are shared (VM vCPUs on
  one physical core, other jobs running) no pipeline can reach the ideal, and the table says so
  in its last columns (:func:`attainable_speedup` for the measured capacity, and the efficiency
  against it).

The model is a wide MLP (``depth`` blocks of ``Linear(width, width) + ReLU``, then a head), so
each stage computes far more than it sends (one ``micro-batch x width`` activation).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.fabric.plugins.environments.lightning import find_free_network_port  # noqa: E402
from torch import nn  # noqa: E402

from src.engine.strategies.pipeline.mesh import Layout, build_mesh  # noqa: E402
from src.engine.strategies.pipeline.partition import plan_stages  # noqa: E402
from src.engine.strategies.pipeline.runner import PipelineRunner  # noqa: E402
from src.engine.strategies.pipeline.schedule import canonical_schedule, check_schedule  # noqa: E402

DEFAULTS: dict[str, Any] = dict(
    micro_batches=(1, 2, 4, 8), stages=2, width=1024, depth=8, batch=1024, steps=3, warmup=1, rounds=3,
    schedules=("GPipe", "1F1B"), lr=0.01, seed=0,
)


def wide_mlp(width: int, depth: int, classes: int = 10) -> nn.Sequential:
    """``fc0 .. fc{depth-1}`` (Linear + ReLU) and ``head``: equal blocks, so stages balance by parameters."""
    blocks: OrderedDict[str, nn.Module] = OrderedDict(
        (f"fc{i}", nn.Sequential(nn.Linear(width, width), nn.ReLU())) for i in range(depth)
    )
    blocks["head"] = nn.Linear(width, classes)
    return nn.Sequential(blocks)


def ideal_speedup(p: int, m: int) -> float:
    return p * m / (m + p - 1)


def attainable_speedup(p: int, m: int, capacity: float) -> float:
    """The ideal speedup when ``p`` processes get only ``capacity`` cores' worth of compute together.

    Slot model of the fill-drain schedule: in slot ``k`` the stages with a micro-batch to work on
    are busy; a slot lasts one stage-micro-batch time when they fit in ``capacity`` cores, longer
    in proportion when they must share. Equals :func:`ideal_speedup` when ``capacity >= p``.
    """
    capacity = max(1.0, capacity)  # one process alone defines one core; less is noise from other jobs
    slots = [sum(0 <= k - s < m for s in range(p)) for k in range(m + p - 1)]
    return p * m / sum(max(1.0, busy / capacity) for busy in slots)


def _timed(step, steps: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()  # the round ends when the slowest rank is done
    return time.perf_counter() - start


def _worker(rank: int, world: int, port: int, cfg: dict[str, Any], queue: Any) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(cfg["seed"])
        net = wide_mlp(cfg["width"], cfg["depth"])
        x = torch.randn(cfg["batch"], cfg["width"])
        y = torch.randint(0, 10, (cfg["batch"],))
        reference = wide_mlp(cfg["width"], cfg["depth"]) if rank == 0 else None
        if reference is not None:
            reference.load_state_dict(net.state_dict())
            ref_opt = torch.optim.SGD(reference.parameters(), lr=cfg["lr"])

        plan = plan_stages(net, world)
        stage = nn.Sequential(OrderedDict((b, getattr(net, b)) for b in plan[rank].blocks))
        mesh = build_mesh("cpu", Layout(pp=world, dp=1))
        opt = torch.optim.SGD(stage.parameters(), lr=cfg["lr"])
        runners = {(name, m): PipelineRunner([(rank, stage)], world, mesh, torch.device("cpu"), name, m,
                                             F.cross_entropy) for name, m in _pipelines(cfg)}

        def unsplit_step() -> None:
            if reference is not None:  # the other ranks wait at the barrier
                ref_opt.zero_grad(set_to_none=True)
                F.cross_entropy(reference(x), y).backward()
                ref_opt.step()

        def pipeline_step(key: tuple[str, int]):
            def step() -> None:
                opt.zero_grad(set_to_none=True)
                runners[key].train_step(x, y)
                opt.step()
            return step

        # Calibration: the same matmuls on one process alone, then on every process at once. Their time
        # ratio is how many cores' worth of compute the processes really get together (a VM's vCPUs can
        # share one physical core, and other jobs compete for them).
        a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)

        def matmuls() -> None:
            for _ in range(4):
                a @ b

        contenders = {
            "solo": lambda: matmuls() if rank == 0 else None,
            "together": matmuls,
            "unsplit": unsplit_step,
            **{key: pipeline_step(key) for key in runners},
        }
        for step in contenders.values():  # warm-up: allocations, schedule metadata, caches
            _timed(step, cfg["warmup"])
        times: dict[Any, list[float]] = {name: [] for name in contenders}
        for _ in range(cfg["rounds"]):
            for name, step in contenders.items():
                times[name].append(_timed(step, cfg["steps"]))
        if rank == 0:
            queue.put((True, times))
    except BaseException as err:  # report instead of leaving the parent waiting
        queue.put((False, f"rank {rank}: {type(err).__name__}: {err}"))
        raise
    finally:
        dist.destroy_process_group()


def _pipelines(cfg: dict[str, Any]) -> list[tuple[str, int]]:
    """The ``(schedule, m)`` contenders: every schedule at every ``m`` it accepts (1F1B needs ``m >= p``)."""
    return [(name, m) for name in cfg["schedules"] for m in cfg["micro_batches"]
            if name != "1F1B" or m >= cfg["stages"]]


def run(out: str | os.PathLike | None = None, **overrides: Any) -> dict[str, Any]:
    """Run the benchmark (see module docstring); returns the results and writes ``results.json`` to ``out``."""
    cfg = {**DEFAULTS, **overrides}
    cfg["micro_batches"] = tuple(int(m) for m in cfg["micro_batches"])
    cfg["schedules"] = tuple(canonical_schedule(name) for name in cfg["schedules"])
    p = cfg["stages"]
    for name, m in _pipelines(cfg):
        check_schedule(name, m, 1, pp=p)
    for m in cfg["micro_batches"]:
        if cfg["batch"] % m:
            raise ValueError(f"batch={cfg['batch']} must be divisible by every micro-batch count (got m={m})")
    load_before = os.getloadavg()[0]  # other work on the machine skews the result: record it
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = find_free_network_port()
    procs = [ctx.Process(target=_worker, args=(r, p, port, cfg, queue)) for r in range(p)]
    for proc in procs:
        proc.start()
    try:
        ok, times = queue.get(timeout=3600)
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    if not ok:
        raise RuntimeError(times)

    samples = cfg["batch"] * cfg["steps"]
    base = samples / statistics.median(times["unsplit"])
    capacity = p * statistics.median(times["solo"]) / statistics.median(times["together"])
    rows = []
    for name, m in _pipelines(cfg):
        throughput = samples / statistics.median(times[(name, m)])
        ideal, attainable = ideal_speedup(p, m), attainable_speedup(p, m, capacity)
        rows.append(dict(schedule=name, m=m, samples_per_s=throughput, speedup=throughput / base, ideal=ideal,
                         efficiency=throughput / base / ideal, bubble=(p - 1) / (m + p - 1),
                         attainable=attainable, efficiency_vs_attainable=throughput / base / attainable))
    result = {
        "benchmark": "pipeline",
        "config": {**cfg, "micro_batches": list(cfg["micro_batches"]), "schedules": list(cfg["schedules"])},
        "threads_per_process": 1,
        "unsplit_samples_per_s": base,
        "parallel_capacity_cores": capacity,
        "rows": rows,
        "round_seconds": {k if isinstance(k, str) else f"{k[0]} m={k[1]}": v for k, v in times.items()},
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "load_average_1min": {"before": load_before, "after": os.getloadavg()[0]},
    }
    if out is not None:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "results.json").write_text(json.dumps(result, indent=2))
    return result


def markdown(result: dict[str, Any]) -> str:
    """The results as a Markdown table."""
    cfg = result["config"]
    lines = [
        f"Pipeline, p = {cfg['stages']} stages, wide MLP {cfg['depth']}x{cfg['width']}, "
        f"global batch {cfg['batch']}, 1 thread per process; unsplit model on one process: "
        f"{result['unsplit_samples_per_s']:.0f} samples/s (load average before/after: "
        f"{result['load_average_1min']['before']:.1f}/{result['load_average_1min']['after']:.1f} "
        f"on {result['cpu_count']} cores)",
        f"Calibration: {cfg['stages']} processes computing at once got "
        f"{result['parallel_capacity_cores']:.2f} cores' worth of compute (ideal: {cfg['stages']})",
        "",
        "| schedule | m | samples/s | speedup | ideal p·m/(m+p−1) | efficiency | attainable here "
        "| efficiency vs attainable |",
        "|:---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(f"| {r['schedule']} | {r['m']} | {r['samples_per_s']:.0f} | {r['speedup']:.2f} | {r['ideal']:.2f} | "
                     f"{r['efficiency']:.2f} | {r['attainable']:.2f} | {r['efficiency_vs_attainable']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/pipeline", help="directory for results.json")
    parser.add_argument("--micro-batches", type=int, nargs="+", default=list(DEFAULTS["micro_batches"]))
    for key in ("stages", "width", "depth", "batch", "steps", "warmup", "rounds"):
        parser.add_argument(f"--{key}", type=int, default=DEFAULTS[key])
    parser.add_argument("--schedules", nargs="+", default=list(DEFAULTS["schedules"]))
    args = vars(parser.parse_args(argv))
    out = args.pop("out")
    result = run(out=out, **args)
    print(markdown(result))
    print(f"\nwrote {Path(out) / 'results.json'}")


if __name__ == "__main__":
    main()
