"""Start-up and memory: a 1-epoch run, from the command to the first optimizer step and to exit; peak RSS."""

from __future__ import annotations

import subprocess
import sys

from scripts.bench import contenders, measure
from scripts.bench.contenders import ROOT
from scripts.bench.context import (
    Bench,
    Goal,
    SuiteResult,
    difference,
    headline,
    median,
    per_round,
    same_round,
    spread,
)
from scripts.bench.report import grouped_bars

# What each entry point imports before it can do anything (timed in a fresh interpreter).
IMPORTS = {
    "project": "import src.train",
    "plain loop": "import scripts.bench.plain_loop",  # torch, numpy; torchvision only for --data per_sample
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
        "plain loop": lambda prefix, run_dir: contenders.plain(work, prefix, run_dir=run_dir),
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
    rss = {n: per_round(runs[n], measure.peak_rss_mb) for n in makers}
    # Same-round comparisons with the plain loop, reported as median (min-max) over rounds.
    first_extra = {n: same_round(first[n], first["plain loop"], difference) for n in makers}
    exit_extra = {n: same_round(exit_s[n], exit_s["plain loop"], difference) for n in makers}
    rss_ratio = {n: same_round(rss[n], rss["plain loop"]) for n in makers}
    result = SuiteResult("startup", f"Start-up and memory, 1-epoch run (train, validate, test), {s.device_label()}")
    result.columns = ["contender", "imports s", "to first step s", "first step vs plain", "to exit s",
                      "exit vs plain", "peak RSS MiB", "RSS vs plain"]
    for n in makers:
        result.rows.append([n, spread(imports[n]), spread(first[n]), headline(first_extra[n], "{:+.2f}", " s"),
                            spread(exit_s[n]), headline(exit_extra[n], "{:+.2f}", " s"), spread(rss[n]),
                            headline(rss_ratio[n], "{:.2f}")])
    for n in makers:
        if not any(run.ok for run in runs[n]):
            result.notes.append(runs[n][0].error())

    extra, mem = median(first_extra["project"]), median(rss_ratio["project"])
    result.goals = [
        Goal("first step <= plain script + 2 s", headline(first_extra["project"], "{:+.2f}", " s"),
             extra <= 2.0 if extra is not None else None),
        Goal("peak RSS <= 1.15x plain script", headline(rss_ratio["project"], "{:.2f}"),
             mem <= 1.15 if mem else None),
    ]
    result.notes.append(
        f"Headline: start-up + 1 epoch, the whole process from launch to exit, project - plain loop in the same "
        f"round: {headline(exit_extra['project'], '{:+.2f}', ' s')}.")
    result.notes.append(
        "Both run one whole epoch, validation, a checkpoint save and a test pass; the project with its defaults "
        "(config tree printed, model summary, sanity check, checkpoints, metric plot). Start-up = launch to the end "
        f"of the first optimizer step. {s.rounds} rounds alternating; values: median (min-max); 'vs plain': "
        "median (min-max) of the same-round differences or ratios. Peak RSS: the kernel's high-water mark of "
        "the whole process from wait4, teardown included. 'imports s' times the entry point's imports alone in a "
        "fresh interpreter.")
    result.notes.append(bench.noise_note([run for v in runs.values() for run in v]))
    result.raw = {"first_step_s": first, "exit_s": exit_s, "peak_rss_mb": rss, "imports_s": imports,
                  "first_step_extra_s_same_round": first_extra["project"],
                  "exit_extra_s_same_round": exit_extra["project"], "rss_ratio_same_round": rss_ratio["project"],
                  "accelerator": s.accelerator, "precision": s.precision, "device": s.device}
    if s.accelerator != "cpu":
        result.raw["peak_cuda_mb"] = {n: per_round(runs[n], measure.peak_cuda_mb) for n in makers}
    plot = bench.out / "startup.png"
    grouped_bars(plot, {n: {"imports": median(imports[n]) or 0, "first step": median(first[n]) or 0,
                            "exit": median(exit_s[n]) or 0} for n in makers},
                 "seconds from launch (median of rounds)", "Start-up, 1-epoch run")
    result.plots.append(plot.name)
    return result
