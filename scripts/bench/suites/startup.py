"""Start-up and memory: a 1-epoch run, from the command to the first optimizer step and to exit; peak RSS."""

from __future__ import annotations

import subprocess
import sys

from scripts.bench import contenders, measure
from scripts.bench.contenders import ROOT
from scripts.bench.context import Bench, Goal, SuiteResult, best, median, per_round, ratio, spread
from scripts.bench.report import grouped_bars

# What each entry point imports before it can do anything (timed in a fresh interpreter).
IMPORTS = {
    "project": "import src.train",
    "plain loop": "import torch, torchvision; import scripts.bench.plain_loop",
}


def import_seconds(statement: str, threads: int) -> float:
    code = f"import time; t = time.perf_counter(); {statement}; print(time.perf_counter() - t)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=contenders.env(threads), check=True,
                         capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def makers_of(work: contenders.Work) -> dict:
    """Contender name -> ``make_cmd(prefix, run_dir)``."""
    return {
        "project": lambda prefix, run_dir: contenders.project(work, prefix, run_dir),
        "plain loop": lambda prefix, run_dir: contenders.plain(work, prefix),
    }


def run(bench: Bench) -> SuiteResult:
    s = bench.settings
    work = contenders.Work(epochs=1, **s.on_device())
    makers = makers_of(work)
    runs: dict[str, list[measure.Run]] = {name: [] for name in makers}
    imports: dict[str, list[float]] = {name: [] for name in makers}
    for r in range(s.rounds):
        print(f" round {r + 1}/{s.rounds}", flush=True)
        for name, make in makers.items():
            runs[name].append(bench.run(f"startup-{name.replace(' ', '-')}-r{r}", make))
            imports[name].append(import_seconds(IMPORTS[name], s.threads))

    first = {n: per_round(runs[n], measure.first_step_s) for n in makers}
    exit_s = {n: per_round(runs[n], lambda run: run.wall_s) for n in makers}
    rss = {n: per_round(runs[n], lambda run: measure.peak_rss_mb(run)[0]) for n in makers}
    result = SuiteResult("startup", f"Start-up and memory, 1-epoch run (train, validate, test), {s.device_label()}")
    result.columns = ["contender", "imports s", "to first step s", "to exit s", "peak RSS MiB"]
    for n in makers:
        result.rows.append([n, spread(imports[n]), spread(first[n]), spread(exit_s[n]), spread(rss[n])])
    for n in makers:
        if not any(run.ok for run in runs[n]):
            result.notes.append(runs[n][0].error())

    # Start-up: each contender's least-disturbed round; memory is not slowed by other processes: medians.
    top_first = {n: best(v, higher=False) for n, v in first.items()}
    extra = top_first["project"] - top_first["plain loop"] if None not in top_first.values() else None
    rss_ratio = ratio(median(rss["project"]), median(rss["plain loop"]))
    result.goals = [
        Goal("first step <= plain script + 2 s", f"+{extra:.2f} s" if extra is not None else "-",
             extra <= 2.0 if extra is not None else None),
        Goal("peak RSS <= 1.15x plain script", f"{rss_ratio:.2f}x" if rss_ratio else "-",
             rss_ratio <= 1.15 if rss_ratio else None),
    ]
    result.notes.append(
        "Both run one whole epoch, validation and a test pass; the project with its defaults (config tree printed, "
        "model summary, sanity check, checkpoint, metric plot). Start-up = launch to the end of the first "
        f"optimizer step. {s.rounds} rounds alternating; median (min-max); the goal compares the best rounds. "
        "'imports s' times the entry point's "
        "imports alone in a fresh interpreter.")
    result.notes.append(bench.noise_note([run for v in runs.values() for run in v]))
    result.raw = {"first_step_s": first, "exit_s": exit_s, "peak_rss_mb": rss, "imports_s": imports,
                  "accelerator": s.accelerator, "precision": s.precision, "device": s.device}
    if s.accelerator != "cpu":
        result.raw["peak_cuda_mb"] = {n: per_round(runs[n], measure.peak_cuda_mb) for n in makers}
    plot = bench.out / "startup.png"
    grouped_bars(plot, {n: {"imports": median(imports[n]) or 0, "first step": median(first[n]) or 0,
                            "exit": median(exit_s[n]) or 0} for n in makers},
                 "seconds from launch", "Start-up, 1-epoch run")
    result.plots.append(plot.name)
    return result
