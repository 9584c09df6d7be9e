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
    difference,
    headline,
    median,
    per_round,
    same_round,
    spread,
)
from scripts.bench.data_pipeline import in_threads, per_sample_batch_ms, project_batch_ms
from scripts.bench.report import bar_chart


def work_of(s: Settings) -> contenders.Work:
    return contenders.Work(epochs=s.epochs, limit_train_batches=s.limit_train_batches, batch_size=s.batch_size,
                           **s.on_device())


def makers_of(work: contenders.Work, workers: tuple[int, ...], variants: tuple = ()) -> dict:
    """Contender name -> ``make_cmd(prefix, run_dir)``; bare Lightning and the per-sample pipeline: mlp only."""
    both = {
        "project": lambda prefix, run_dir: contenders.project(work, prefix, run_dir),
        "plain loop": lambda prefix, run_dir: contenders.plain(work, prefix, run_dir=run_dir),
        **{f"project {name}": partial(lambda o, prefix, run_dir: contenders.project(work, prefix, run_dir, *o), overrides)
           for name, overrides in variants},
    }
    if work.workload != "mlp":
        return both
    return {
        **both,
        "bare Lightning": lambda prefix, run_dir: contenders.bare_lightning(work, prefix, run_dir=run_dir),
        **{f"per-sample, {w} workers": partial(
            lambda w, prefix, run_dir: contenders.plain(work, prefix, "per_sample", w, run_dir=run_dir), w)
           for w in workers},
    }


def paired_makers_of(work: contenders.Work) -> dict:
    """The paired runs: bare Lightning and the project, each with an interleaved plain step."""
    return {"bare": lambda prefix, run_dir: contenders.bare_lightning(work, prefix, paired=True, run_dir=run_dir),
            "project": lambda prefix, run_dir: contenders.project_paired(work, prefix, run_dir)}


def run(bench: Bench) -> SuiteResult:
    s = bench.settings
    work = work_of(s)
    makers = makers_of(work, s.workers, s.variants)
    runs: dict[str, list[measure.Run]] = {name: [] for name in makers}
    for r in range(s.rounds):
        print(f" round {r + 1}/{s.rounds}", flush=True)
        for name, make in makers.items():
            runs[name].append(bench.run(f"throughput-{_slug(name)}-r{r}", make))

    # Every number per round; every comparison is a same-round ratio, reported as median (min-max).
    tput = {name: per_round(runs[name], measure.epoch_throughput) for name in makers}
    loop = {name: per_round(runs[name], measure.loop_throughput) for name in makers}
    rss = {name: per_round(runs[name], measure.peak_rss_mb) for name in makers}
    vs_plain = {name: same_round(tput[name], tput["plain loop"]) for name in makers}
    loop_vs_plain = {name: same_round(loop[name], loop["plain loop"]) for name in makers}
    rss_vs_plain = {name: same_round(rss[name], rss["plain loop"]) for name in makers}
    wall = {name: per_round(runs[name], lambda run: run.wall_s) for name in makers}
    wall_vs_plain = {name: same_round(wall[name], wall["plain loop"], fn=difference) for name in makers}
    result = SuiteResult("throughput", f"Training throughput, 1 process, {work.workload}, batch {work.global_batch}, "
                                       f"{s.device_label()} (steady state)")
    result.columns = ["contender", "threads", "samples/s, whole epochs", "vs plain loop",
                      "samples/s, training loop only", "vs plain loop (loop only)", "epoch s (train+val+ckpt)",
                      "peak RSS MiB", "RSS vs plain loop", "whole process s (launch to exit)", "vs plain loop"]
    for name in makers:
        ok = result.successful(name, runs[name])
        if not ok:
            continue
        result.rows.append([
            name, str(measure.threads(ok[0])[0]), spread(tput[name]), headline(vs_plain[name]), spread(loop[name]),
            headline(loop_vs_plain[name]), spread([measure.epoch_wall_s(run) for run in ok]), spread(rss[name]),
            headline(rss_vs_plain[name]), spread(wall[name]), headline(wall_vs_plain[name], "{:+.2f}", " s"),
        ])

    paired = _paired_steps(bench, work) if s.paired and work.workload == "mlp" else {"bare": [], "project": []}
    profiles = _step_profiles(bench, makers) if s.accelerator != "cpu" and s.profile else {}

    # The input pipeline alone, in this process with the same thread count (the project's on the contenders' device).
    mlp = work.workload == "mlp"
    data_ms = in_threads(s.threads, project_batch_ms, work.global_batch, 200, s.accelerator) if mlp else None
    per_sample_ms = {w: in_threads(s.threads, per_sample_batch_ms, w, work.global_batch) for w in s.workers
                     if data_ms is not None}
    project_loop = median(loop["project"])
    project_step_ms = work.global_batch / project_loop * 1e3 if project_loop else None
    share = data_ms / project_step_ms if project_step_ms and data_ms is not None else None
    per_sample = [n for n in makers if n.startswith("per-sample")]
    fastest_per_sample = [max((v for v in vals if v is not None), default=None)
                          for vals in zip(*(tput[n] for n in per_sample), strict=True)] if per_sample else []
    speedup = same_round(tput["project"], fastest_per_sample) if per_sample else []

    project_ratio = median(vs_plain["project"])
    floor = same_round(tput["bare Lightning"], tput["plain loop"]) if "bare Lightning" in tput else []
    added = same_round(tput["project"], tput["bare Lightning"]) if "bare Lightning" in tput else []
    result.goals = [
        Goal("project >= 0.97x plain loop (whole epochs; defaults: progress bar, logging, checkpoints on)",
             headline(vs_plain["project"]), project_ratio >= 0.97 if project_ratio else None),
        Goal("input pipeline <= 10% of the project's step time",
             f"{data_ms:.3f} ms of {project_step_ms:.2f} ms = {100 * share:.1f}%" if share else "-",
             share <= 0.10 if share else None),
        Goal("project epoch >= 3x faster than the per-sample pipeline (its best worker count)",
             headline(speedup, "{:.1f}"), median(speedup) >= 3 if median(speedup) else None),
    ]
    if median(floor) and median(added):
        result.notes.append(
            f"Whole epochs, same-round medians: bare Lightning (`Trainer(barebones=True)`, same work, no logging/"
            f"progress/callbacks) ran at {headline(floor)} the plain loop, the project at {headline(added)} bare "
            "Lightning.")
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
    if data_ms is not None:
        result.notes.append(
            f"Input pipeline alone: project {data_ms:.3f} ms/batch; per-sample "
            + (", ".join(f"{w} workers {ms:.2f} ms/batch" for w, ms in per_sample_ms.items())
               or "not run (--workers '')") + ".")
    result.notes.append(
        f"Steady state: epochs 2..{s.epochs} of each run (epoch 1 is warm-up). Whole epochs run from one epoch's "
        "start to the next one's (the last: to the end of training), so they hold validation, the checkpoint "
        "save and logging; 'training loop only' stops at each epoch's last optimizer step. Every contender "
        "validates and saves model and optimizer state each epoch. "
        f"{'Whole epochs' if not s.limit_train_batches else f'{s.limit_train_batches} training steps/epoch'}"
        f", global batch {work.global_batch}; {s.rounds} rounds, contenders alternating. Values: median (min-max) "
        "over rounds; ratios: median (min-max) of the ratios within each round. Peak RSS: the kernel's "
        "high-water mark of the whole process (wait4), teardown included.")
    if s.accelerator != "cpu":
        result.notes.append(
            f"On {s.device_label()}: every contender trains on the GPU (the project with trainer.accelerator="
            f"{s.accelerator} trainer.precision={s.precision}). The plain loop, bare Lightning and the project "
            "(data.on_device=auto) hold the data set on the device, normalized once; the per-sample pipeline builds "
            "batches on the CPU and copies them from pinned memory. Epoch spans start and end after "
            "torch.cuda.synchronize(). The project's input pipeline alone is timed on the GPU; the per-sample one "
            "on the CPU, without the copy.")
    if profiles:
        result.notes.append(_profile_table(profiles))
    result.notes.append(bench.noise_note([run for v in runs.values() for run in v]))
    result.raw = {"samples_per_s": tput, "loop_samples_per_s": loop, "project_over_plain_same_round": vs_plain["project"],
                  "vs_plain_same_round": vs_plain, "loop_vs_plain_same_round": loop_vs_plain,
                  "paired_steps": paired,
                  "other_load": {n: per_round(runs[n], lambda r: r.other_load) for n in makers}, "data_ms_per_batch": data_ms,
                  "per_sample_ms_per_batch": per_sample_ms, "data_share_of_step": share,
                  "speedup_over_per_sample": median(speedup), "speedup_over_per_sample_same_round": speedup,
                  "bare_lightning_over_plain": median(floor), "project_over_bare_lightning": median(added),
                  "peak_rss_mb": rss, "rss_vs_plain_same_round": rss_vs_plain, "step_profiles": profiles,
                  "process_s": wall, "process_s_minus_plain_same_round": wall_vs_plain,
                  "accelerator": s.accelerator, "precision": s.precision, "device": s.device}
    if s.accelerator != "cpu":
        result.raw["peak_cuda_mb"] = {n: per_round(runs[n], measure.peak_cuda_mb) for n in makers}
    plot = bench.out / "throughput.png"
    bar_chart(plot, {n: median(v) or 0 for n, v in tput.items()}, "samples/s (whole epochs, median of rounds)",
              f"Training throughput, 1 process, {s.device_label()}",
              labels={n: f"{median(v):.3f}x plain" for n, v in vs_plain.items() if median(v)})
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


PROFILED = ("project", "bare Lightning", "plain loop")
PROFILE_STEPS = 50


def _step_profiles(bench: Bench, makers: dict) -> dict[str, dict]:
    """One extra, untimed run per contender with ``BENCH_PROFILE_STEPS``: where each steady step's time goes."""
    profiles = {}
    for name in (n for n in PROFILED if n in makers):
        run = bench.run(f"profile-{_slug(name)}", makers[name], extra_env={"BENCH_PROFILE_STEPS": str(PROFILE_STEPS)})
        profile = next((t.get("profile") for t in run.timelines if t.get("profile")), None) if run.ok else None
        if profile:
            profiles[name] = profile
    return profiles


def _profile_table(profiles: dict[str, dict]) -> str:
    """The split of a steady step, per contender (ms per step), and what caused each host-device sync."""
    lines = [f"Where a steady step's time goes ({PROFILE_STEPS} profiled steps of epoch 2, in an extra untimed run "
             "per contender; ms per step):", "",
             "| contender | wall | host CPU | GPU busy | GPU idle | kernels | host syncs |", "|---|---|---|---|---|---|---|"]
    for name, p in profiles.items():
        lines.append(f"| {name} | {p['wall_ms']:.3f} | {p['cpu_ms']:.3f} | {p['gpu_busy_ms']:.3f} | "
                     f"{p['gpu_idle_ms']:.3f} | {p['kernels']:.1f} | {p['syncs']:.2f} |")
    for name, p in profiles.items():
        sites = "; ".join(f"{site} ({n:.2f}/step)" for site, n in p["sync_sites"].items()) or "none"
        top = ", ".join(f"{op} {ms:.3f}" for op, ms in list(p["top_ops"].items())[:6])
        lines.append(f"- {name}: syncs: {sites}. Most host time (ms/step): {top}.")
    return "\n".join(lines)


def _ms_list(values: list[float]) -> str:
    return ", ".join(f"{v:+.2f}" for v in values)


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name).strip("-").replace("--", "-")
