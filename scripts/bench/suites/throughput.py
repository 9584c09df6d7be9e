"""1 process: steady-state training samples/s of the project vs a plain loop vs the per-sample pipeline."""

from __future__ import annotations

import json
from functools import partial

from scripts.bench import contenders, measure
from scripts.bench.context import (
    Bench,
    Goal,
    Settings,
    SuiteResult,
    best,
    median,
    per_round,
    ratio,
    show,
    spread,
)
from scripts.bench.data_pipeline import in_threads, per_sample_batch_ms, project_batch_ms
from scripts.bench.report import bar_chart


def work_of(s: Settings) -> contenders.Work:
    return contenders.Work(epochs=s.epochs, limit_train_batches=s.limit_train_batches, batch_size=s.batch_size,
                           **s.on_device())


def makers_of(work: contenders.Work, workers: tuple[int, ...]) -> dict:
    """Contender name -> ``make_cmd(prefix, run_dir)``."""
    return {
        "project": lambda prefix, run_dir: contenders.project(work, prefix, run_dir),
        "plain loop": lambda prefix, run_dir: contenders.plain(work, prefix),
        "bare Lightning": lambda prefix, run_dir: contenders.bare_lightning(work, prefix),
        **{f"per-sample, {w} workers": partial(lambda w, prefix, run_dir: contenders.plain(work, prefix, "per_sample", w), w)
           for w in workers},
    }


def paired_makers_of(work: contenders.Work) -> dict:
    """The paired runs: bare Lightning and the project, each with an interleaved plain step."""
    return {"bare": lambda prefix, run_dir: contenders.bare_lightning(work, prefix, paired=True),
            "project": lambda prefix, run_dir: contenders.project_paired(work, prefix, run_dir)}


def run(bench: Bench) -> SuiteResult:
    s = bench.settings
    work = work_of(s)
    makers = makers_of(work, s.workers)
    runs: dict[str, list[measure.Run]] = {name: [] for name in makers}
    for r in range(s.rounds):
        print(f" round {r + 1}/{s.rounds}", flush=True)
        for name, make in makers.items():
            runs[name].append(bench.run(f"throughput-{_slug(name)}-r{r}", make))

    tput = {name: per_round(runs[name], measure.steady_throughput) for name in makers}
    top = {name: best(v) for name, v in tput.items()}
    round_ratios = [ratio(p, q) for p, q in zip(tput["project"], tput["plain loop"], strict=True)]
    result = SuiteResult("throughput", f"Training throughput, 1 process, batch {work.global_batch}, "
                                       f"{s.device_label()} (steady state)")
    result.columns = ["contender", "threads", "samples/s best", "vs plain loop", "samples/s median (min-max)",
                      "ms/step", "epoch s (train+val)", "peak RSS MiB"]
    for name in makers:
        ok = result.successful(name, runs[name])
        if not ok:
            continue
        result.rows.append([
            name, str(measure.threads(ok[0])[0]), f"{top[name]:,.0f}", show(ratio(top[name], top["plain loop"]), "{:.3f}x"),
            spread(tput[name]), f"{work.global_batch / top[name] * 1e3:.2f}",
            spread([measure.epoch_wall_s(run) for run in ok]), spread([measure.peak_rss_mb(run)[0] for run in ok]),
        ])

    paired = _paired_steps(bench, work) if s.paired else {"bare": [], "project": []}

    # The input pipeline alone, in this process with the same thread count (the project's on the contenders' device).
    data_ms = in_threads(s.threads, project_batch_ms, work.global_batch, 200, s.accelerator)
    per_sample_ms = {w: in_threads(s.threads, per_sample_batch_ms, w, work.global_batch) for w in s.workers}
    project_step_ms = work.global_batch / top["project"] * 1e3 if top["project"] else None
    share = data_ms / project_step_ms if project_step_ms else None
    speedup = ratio(top["project"], max((top[n] or 0 for n in makers if n.startswith("per-sample")), default=0))

    vs_plain = ratio(top["project"], top["plain loop"])
    floor, added = ratio(top["bare Lightning"], top["plain loop"]), ratio(top["project"], top["bare Lightning"])
    result.goals = [
        Goal("project >= 0.97x plain loop (defaults: progress bar, logging on)",
             f"{vs_plain:.3f}x (same-round median {median(round_ratios):.3f}x)" if vs_plain and median(round_ratios) else "-",
             vs_plain >= 0.97 if vs_plain else None),
        Goal("input pipeline <= 10% of the project's step time",
             f"{data_ms:.3f} ms of {project_step_ms:.2f} ms = {100 * share:.1f}%" if share else "-",
             share <= 0.10 if share else None),
        Goal("project epoch >= 3x faster than the per-sample pipeline (its best worker count)",
             f"{speedup:.1f}x" if speedup else "-", speedup >= 3 if speedup else None),
    ]
    if floor and added:
        result.notes.append(
            f"Separate runs: bare Lightning (`Trainer(barebones=True)`, same work, no logging/progress/callbacks) "
            f"ran at {floor:.3f}x the plain loop, the project at {added:.3f}x bare Lightning.")
    if paired["bare"] and paired["project"]:
        loop_ms = median(paired["bare"])
        template_ms = median(paired["project"]) - loop_ms
        result.notes.append(
            f"Paired steps (a plain step timed after every Lightning step, in the same process; median over "
            f"{s.rounds} rounds): Lightning's own loop costs {loop_ms:+.2f} ms per step, the template's defaults "
            f"{template_ms:+.2f} ms on top (rounds: bare {_ms_list(paired['bare'])}, project "
            f"{_ms_list(paired['project'])} ms over the plain step).")
    elif not s.paired:
        result.notes.append("Paired steps: not run (--no-paired).")
    result.notes.append(
        f"Input pipeline alone: project {data_ms:.3f} ms/batch; per-sample "
        + (", ".join(f"{w} workers {ms:.2f} ms/batch" for w, ms in per_sample_ms.items()) or "not run (--workers '')")
        + ".")
    result.notes.append(
        f"Steady state: epochs 2..{s.epochs} of each run (epoch 1 is warm-up), each epoch from its start to its "
        f"last optimizer step; {'whole epochs' if not s.limit_train_batches else f'{s.limit_train_batches} steps/epoch'}"
        f", global batch {work.global_batch}; {s.rounds} rounds, contenders alternating. Ratios compare each contender's "
        "best round; the same-round median is the median over rounds of project/plain in the same round.")
    if s.accelerator != "cpu":
        result.notes.append(
            f"On {s.device_label()}: every contender trains on the GPU (the project with trainer.accelerator="
            f"{s.accelerator} trainer.precision={s.precision}). The plain loop and bare Lightning hold the uint8 data "
            "set on the device and normalize there; the project copies each uint8 batch from pinned memory and "
            "normalizes on the device; the per-sample pipeline builds batches on the CPU and copies them from pinned "
            "memory. Epoch spans start and end after torch.cuda.synchronize(). The project's input pipeline alone "
            "is timed with its normalization on the GPU; the per-sample one on the CPU, without the copy.")
    result.notes.append(bench.noise_note([run for v in runs.values() for run in v]))
    result.raw = {"samples_per_s": tput, "project_over_plain_same_round": round_ratios, "paired_steps": paired,
                  "other_load": {n: per_round(runs[n], lambda r: r.other_load) for n in makers}, "data_ms_per_batch": data_ms,
                  "per_sample_ms_per_batch": per_sample_ms, "data_share_of_step": share,
                  "speedup_over_per_sample": speedup,
                  "bare_lightning_over_plain": floor, "project_over_bare_lightning": added,
                  "peak_rss_mb": {n: per_round(runs[n], lambda r: measure.peak_rss_mb(r)[0]) for n in makers},
                  "accelerator": s.accelerator, "precision": s.precision, "device": s.device}
    if s.accelerator != "cpu":
        result.raw["peak_cuda_mb"] = {n: per_round(runs[n], measure.peak_cuda_mb) for n in makers}
    plot = bench.out / "throughput.png"
    bar_chart(plot, {n: v or 0 for n, v in top.items()}, "samples/s (steady state, best round)",
              f"Training throughput, 1 process, {s.device_label()}", reference="plain loop")
    result.plots.append(plot.name)
    return result


def _paired_steps(bench: Bench, work: contenders.Work) -> dict[str, list[float]]:
    """Per round, the median Lightning step minus the median interleaved plain step (ms): bare Lightning, project."""
    makers = paired_makers_of(work)
    gaps: dict[str, list[float]] = {name: [] for name in makers}
    for r in range(bench.settings.rounds):
        for name, make in makers.items():
            run = bench.run(f"paired-{name}-r{r}", make)
            path = contenders.paired_path(bench.out / "timelines" / f"paired-{name}-r{r}")
            if run.ok and path.exists():
                record = json.loads(path.read_text())
                gaps[name].append(record["lightning_ms"] - record["plain_ms"])
    return gaps


def _ms_list(values: list[float]) -> str:
    return ", ".join(f"{v:+.2f}" for v in values)


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name).strip("-").replace("--", "-")
