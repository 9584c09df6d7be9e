"""``trainer=ps`` against ``trainer=ddp`` when one worker is slow, and how far the parameter servers scale.

    python -m scripts.studies.ps_vs_ddp                               # 2 rounds of the slow-worker runs, scale 3 s each
    python -m scripts.studies.ps_vs_ddp --rounds 3 --seconds 5 --delay 0.05 --out logs/bench/ps
    python -m scripts.studies.ps_vs_ddp --skip-slow                   # the scale measurements alone

1. **Slow worker** (the project, ``python src/train.py experiment=toy``, real processes on gloo): every worker
   sleeps ``--delay`` s before each step (:class:`src.engine.callbacks.slow_rank.SlowRank`), one of three ``--factor``
   times as long. Under ``trainer=ps`` (1 server + 3 workers) and ``trainer=ddp`` (3 ranks) each round runs the
   undisturbed and the slowed job side by side; the figure is the fast ranks' steps per second slowed / undisturbed,
   median (min-max) of the same-round ratios. The sleep dominates the step, so rates compare on a loaded machine.
2. **Scale** (the strategy's own server and client, :mod:`src.engine.strategies.ps`, without Lightning): S servers and W
   workers exchange the project's MLP (Fashion-MNIST, hidden 512-256, Adam on the servers) for ``--seconds``.
   ``push``: workers push a ready gradient as fast as they can (what the servers sustain); ``train``: each push
   follows a forward and backward pass on a batch of 64 (updates per second of real training). One update is
   one worker's push to every server. Every process has one torch thread; on a machine with fewer cores than
   processes they share them, which the table's header says.
3. A plot of both (``--out``/ps_vs_ddp.png).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from lightning.fabric.plugins.environments.lightning import find_free_network_port

from src.engine.callbacks.slow_rank import read_rates

ROOT = Path(__file__).resolve().parents[2]
TOY = ["experiment=toy", "trainer.accelerator=cpu", "extras.print_config=false", "callbacks.metric_plot=null",
       "logger=csv", "trainer.max_epochs=1", "test=false", "data.batch_size=48"]
SCALE = [(1, 1), (1, 2), (1, 3), (1, 4), (2, 1), (2, 2), (2, 3), (2, 4)]


# -- 1. slow worker ---------------------------------------------------------------------------------------------
def slow_runs(out: Path, rnd: int, steps: int, delay: float, factor: float) -> dict[str, float]:
    """One round: the fast ranks' mean steps/s, slowed / undisturbed, under ps and under ddp."""
    setups = {"ps": (["trainer=ps", "trainer.devices=4"], 3, (1, 2)), "ddp": (["trainer=ddp", "trainer.devices=3"], 2, (0, 1))}
    ratios = {}
    for name, (args, slow_rank, fast) in setups.items():
        rates = {}
        for slowed in (False, True):
            run_dir = out / f"round{rnd}" / f"{name}-{'slow' if slowed else 'base'}"
            extra = [f"+callbacks.slow.slow_ranks=[{slow_rank}]"] if slowed else []
            proc = subprocess.run(
                [sys.executable, str(ROOT / "src" / "train.py"), *args, *TOY, f"++trainer.limit_train_batches={steps}",
                 "+callbacks.slow._target_=src.engine.callbacks.slow_rank.SlowRank", f"+callbacks.slow.delay_s={delay}",
                 f"+callbacks.slow.factor={factor}", *extra, f"hydra.run.dir={run_dir}"],
                cwd=ROOT, capture_output=True, text=True, timeout=600)
            if proc.returncode != 0:
                raise SystemExit(f"{name} run failed:\n{proc.stderr[-3000:]}")
            per_rank = read_rates(run_dir)
            rates[slowed] = statistics.mean(per_rank[r] for r in fast)
        ratios[name] = rates[True] / rates[False]
        ratios[f"{name} base steps/s"] = rates[False]
    return ratios


# -- 2. scale -----------------------------------------------------------------------------------------------------
def _model() -> torch.nn.Module:
    from src.models.components.mlp import MLP

    torch.manual_seed(0)
    return MLP(hidden_sizes=[512, 256])


def scale_rank(rank: int, servers: int, workers: int, port: int, seconds: float, train: bool, queue) -> None:
    from src.engine.strategies.ps.client import ServerClient
    from src.engine.strategies.ps.coordination import JobStore
    from src.engine.strategies.ps.layout import shard_by_size
    from src.engine.strategies.ps.serve import ServerLinks
    from src.engine.strategies.ps.server import ParameterServer

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo")  # links on loopback only
    world = servers + workers
    timeout = dt.timedelta(seconds=120)
    jobs = JobStore(torch.distributed.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timeout), timeout)
    model = _model()
    params = list(model.parameters())
    owner = shard_by_size([p.numel() for p in params], servers)
    shards = [[p for p, o in zip(params, owner, strict=True) if o == s] for s in range(servers)]
    if rank < servers:
        server = ParameterServer(shards[rank], torch.optim.Adam(shards[rank], lr=1e-3), [], workers, None,
                                 torch.device("cpu"))
        links = ServerLinks(server, jobs, rank, timeout, timeout)
        links.start()
        server.open(0, None)
        with contextlib.suppress(Exception):  # server 0 hosts the store: the others may find it gone at the end
            while not jobs.store.check([jobs.key("left", w) for w in range(workers)]):
                time.sleep(0.05)  # poll: a blocking wait would hold the store's client, which the link threads share
            jobs.add("servers done")
            while rank == 0 and jobs.add("servers done", amount=0) < servers:
                time.sleep(0.05)
        links.stop()
        server.close()
        os._exit(0)
    worker = rank - servers
    client = ServerClient(jobs, worker, shards, [], timeout, timeout)
    client.join()
    x, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))

    def step() -> None:
        if train:
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
        elif params[0].grad is None:
            for p in params:
                p.grad = torch.randn_like(p) * 1e-3
        client.push_pull(1.0, 64)

    for _ in range(3):
        step()
    jobs.add("ready")
    while jobs.add("ready", amount=0) < workers:
        time.sleep(0.005)
    count, start = 0, time.monotonic()
    while time.monotonic() - start < seconds:
        step()
        count += 1
    end = time.monotonic()
    client.leave()
    queue.put((start, end, count))
    jobs.store.set(jobs.key("left", worker), "1")
    os._exit(0)


def scale_one(servers: int, workers: int, seconds: float, train: bool) -> float:
    """Updates per second (every worker's pushes over the span of the timed loops)."""
    queue = mp.get_context("spawn").SimpleQueue()
    port = find_free_network_port()
    procs = [mp.get_context("spawn").Process(target=scale_rank, args=(r, servers, workers, port, seconds, train, queue))
             for r in range(servers + workers)]
    for p in procs:
        p.start()
    results = [queue.get() for _ in range(workers)]
    for p in procs:
        p.join(timeout=120)
    return sum(c for _, _, c in results) / (max(e for _, e, _ in results) - min(s for s, _, _ in results))


# -- report -------------------------------------------------------------------------------------------------------
def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def plot(path: Path, slow: dict[str, list[float]], scale: dict[tuple[str, int, int], float], factor: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    if slow:
        names = ["ps", "ddp"]
        left.bar(names, [statistics.median(slow[n]) for n in names], color=["tab:blue", "tab:orange"])
        left.errorbar(names, [statistics.median(slow[n]) for n in names],
                      yerr=[[statistics.median(slow[n]) - min(slow[n]) for n in names],
                            [max(slow[n]) - statistics.median(slow[n]) for n in names]], fmt="none", color="k")
        left.axhline(0.8, ls="--", color="grey")
        left.set_ylim(0, 1.1)
        left.set_ylabel("fast workers' steps/s: slowed / undisturbed")
        left.set_title(f"one of 3 workers {factor:g}x slower")
    for mode, style in (("push", "-"), ("train", "--")):
        for servers in (1, 2):
            points = sorted((w, v) for (m, s, w), v in scale.items() if m == mode and s == servers)
            if points:
                right.plot([w for w, _ in points], [v for _, v in points], style, marker="o",
                           label=f"{mode}, {servers} server{'s' if servers > 1 else ''}")
    right.set_xlabel("workers")
    right.set_ylabel("updates/s")
    right.set_title("parameter-server throughput (MLP, 0.5 M parameters)")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="slow-worker rounds (each: ps and ddp, base and slowed)")
    parser.add_argument("--steps", type=int, default=40, help="training steps per worker in a slow-worker run")
    parser.add_argument("--delay", type=float, default=0.05, help="sleep per step, seconds")
    parser.add_argument("--factor", type=float, default=4.0, help="the slow worker sleeps this many times as long")
    parser.add_argument("--seconds", type=float, default=3.0, help="timed span of each scale measurement")
    parser.add_argument("--skip-slow", action="store_true")
    parser.add_argument("--skip-scale", action="store_true")
    parser.add_argument("--out", type=Path, default=None, help="where runs and the plot go (default: a temp dir)")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="ps_vs_ddp_"))
    out.mkdir(parents=True, exist_ok=True)

    slow: dict[str, list[float]] = {"ps": [], "ddp": [], "ps base steps/s": [], "ddp base steps/s": []}
    if not args.skip_slow:
        for rnd in range(args.rounds):
            for key, value in slow_runs(out, rnd, args.steps, args.delay, args.factor).items():
                slow[key].append(value)
        print(f"\n| one of 3 workers {args.factor:g}x slower ({args.rounds} rounds, {args.delay * 1e3:g} ms sleep/step) "
              "| fast ranks' steps/s, undisturbed | slowed / undisturbed |\n|---|---|---|")
        for name in ("ps", "ddp"):
            print(f"| {name} | {statistics.median(slow[f'{name} base steps/s']):.1f} | {spread(slow[name])} |")

    scale: dict[tuple[str, int, int], float] = {}
    if not args.skip_scale:
        for mode in ("push", "train"):
            for servers, workers in SCALE:
                scale[(mode, servers, workers)] = scale_one(servers, workers, args.seconds, mode == "train")
        print(f"\n| updates/s ({os.cpu_count()} cores, {args.seconds:g} s each) | "
              + " | ".join(f"{w} worker{'s' if w > 1 else ''}" for w in range(1, 5)) + " |\n|---|---|---|---|---|")
        for mode in ("push", "train"):
            for servers in (1, 2):
                print(f"| {mode}, {servers} server{'s' if servers > 1 else ''} | "
                      + " | ".join(f"{scale.get((mode, servers, w), float('nan')):.0f}" for w in range(1, 5)) + " |")
    plot(out / "ps_vs_ddp.png", {k: v for k, v in slow.items() if v and k in ("ps", "ddp")}, scale, args.factor)
    print(f"\nplot: {out / 'ps_vs_ddp.png'}")


if __name__ == "__main__":
    main()
