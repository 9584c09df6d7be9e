"""DDP: the project's ``trainer=ddp`` and ``ddp_fork`` vs a plain torch DDP script vs one process, same global batch."""

from __future__ import annotations

from scripts.bench import contenders, measure
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
from scripts.bench.report import bar_chart


def run(bench: Bench) -> SuiteResult:
    s = bench.settings
    n = s.nproc
    work = contenders.Work(epochs=s.epochs, limit_train_batches=s.limit_train_batches, batch_size=s.batch_size)
    threads_per_rank = max(1, s.threads // n)
    makers = {  # name -> (command builder, ranks, threads per process)
        f"project ddp x{n}": (lambda prefix, run_dir: contenders.project_ddp(work, prefix, run_dir, n), n, threads_per_rank),
        f"project ddp_fork x{n}": (lambda prefix, run_dir: contenders.project_ddp(work, prefix, run_dir, n, "ddp_fork"),
                                   n, threads_per_rank),
        f"plain DDP x{n}": (lambda prefix, run_dir: contenders.plain_ddp(work, prefix, n, run_dir), n, threads_per_rank),
        "project 1 process": (lambda prefix, run_dir: contenders.project(work, prefix, run_dir), 1, s.threads),
    }
    runs: dict[str, list[measure.Run]] = {name: [] for name in makers}
    for r in range(s.rounds):
        print(f" round {r + 1}/{s.rounds}", flush=True)
        for name, (make, ranks, threads) in makers.items():
            runs[name].append(bench.run(f"ddp-{name.replace(' ', '-')}-r{r}", make, world_size=ranks, threads=threads))

    # Per round; comparisons are same-round ratios, reported as median (min-max) over rounds.
    epoch = {name: per_round(runs[name], measure.epoch_throughput) for name in makers}
    loop = {name: per_round(runs[name], measure.loop_throughput) for name in makers}
    overall = {name: per_round(runs[name], lambda run: measure.train_samples(run) / run.wall_s) for name in makers}
    project, plain = f"project ddp x{n}", f"plain DDP x{n}"
    vs_plain = {name: same_round(epoch[name], epoch[plain]) for name in makers}
    loop_vs_plain = {name: same_round(loop[name], loop[plain]) for name in makers}
    first = {name: per_round(runs[name], measure.first_step_s) for name in makers}
    exit_s = {name: per_round(runs[name], lambda run: run.wall_s) for name in makers}
    first_extra = {name: same_round(first[name], first[plain], difference) for name in makers}
    exit_extra = {name: same_round(exit_s[name], exit_s[plain], difference) for name in makers}
    ranks_rss = {name: per_round(runs[name], measure.rank_peak_rss_mb) for name in makers}
    whole_rss = {name: per_round(runs[name], measure.peak_rss_mb) for name in makers}
    result = SuiteResult("ddp", f"DDP, {n} processes on gloo (global batch {work.global_batch})")
    result.columns = ["contender", "threads/rank", "samples/s, whole epochs", "vs plain DDP",
                      "samples/s, training loop only", "vs plain DDP (loop only)", "samples/s incl. start-up",
                      "to first step s", "first step vs plain DDP", "to exit s", "exit vs plain DDP",
                      "peak RSS MiB per rank", "peak RSS MiB, wait4"]
    for name in makers:
        ok = result.successful(name, runs[name])
        if not ok:
            continue
        per_rank = [median([r[i] for r in ranks_rss[name] if r is not None]) for i in range(len(ok[0].timelines))]
        result.rows.append([
            name, str(measure.threads(ok[0])[0]), spread(epoch[name]), headline(vs_plain[name]), spread(loop[name]),
            headline(loop_vs_plain[name]), spread(overall[name]), spread(first[name]),
            headline(first_extra[name], "{:+.2f}", " s"), spread(exit_s[name]), headline(exit_extra[name], "{:+.2f}", " s"),
            " / ".join("-" if v is None else f"{v:,.0f}" for v in per_rank), spread(whole_rss[name]),
        ])
    whole, only_loop = median(vs_plain[project]), median(loop_vs_plain[project])
    result.goals = [
        Goal(f"project ddp >= 0.97x plain DDP script (whole epochs, {n} ranks)", headline(vs_plain[project]),
             whole >= 0.97 if whole else None),
        Goal(f"project ddp >= 0.97x plain DDP script (training loop only, {n} ranks)",
             headline(loop_vs_plain[project]), only_loop >= 0.97 if only_loop else None),
        *(Goal(f"{name}: whole process <= plain DDP script + 3 s", headline(exit_extra[name], "{:+.2f}", " s"),
               median(exit_extra[name]) <= 3.0 if median(exit_extra[name]) is not None else None)
          for name in (project, f"project ddp_fork x{n}")),
    ]
    result.notes.append(
        f"Each rank trains {work.global_batch // n} samples per step ({threads_per_rank} torch thread(s) per rank, "
        f"{n} ranks on {s.threads} cores). Whole epochs hold validation (each rank its shard, sums all-reduced, in "
        "both) and the checkpoint save (rank 0); 'training loop only' stops at each epoch's last optimizer step; "
        "'incl. start-up' divides all trained samples by the launch-to-exit wall time (which also holds "
        f"validation and test). Steady state as in the throughput suite; {s.rounds} rounds, contenders alternating; "
        "values: median (min-max); ratios: median (min-max) of the same-round ratios.")
    result.notes.append(
        "Peak RSS per rank: each rank's VmHWM polled from /proc every 0.2 s, except the launched process, whose "
        "figure is the kernel's from wait4 (the project's rank 0); 'wait4' is the launched process and the "
        "children it waited for (plain DDP: the mp.spawn parent and its joined ranks).")
    if (s.accelerator, s.precision) != ("cpu", "32-true"):
        result.notes.append(f"--accelerator {s.accelerator} --precision {s.precision} do not apply here: this suite "
                            "compares CPU ranks on gloo in 32-true (the project gets trainer.accelerator=cpu).")
    result.notes.append(bench.noise_note([run for v in runs.values() for run in v]))
    result.raw = {"samples_per_s": epoch, "loop_samples_per_s": loop, "overall": overall,
                  "vs_plain_same_round": vs_plain, "loop_vs_plain_same_round": loop_vs_plain,
                  "first_step_s": first, "exit_s": exit_s, "first_step_extra_s_same_round": first_extra,
                  "exit_extra_s_same_round": exit_extra,
                  "other_load": {name: per_round(runs[name], lambda run: run.other_load) for name in makers},
                  "cpu_s": {name: per_round(runs[name], lambda run: run.cpu_s) for name in makers},
                  "rank_peak_rss_mb": ranks_rss, "peak_rss_mb": whole_rss}
    plot = bench.out / "ddp.png"
    bar_chart(plot, {name: median(v) or 0 for name, v in epoch.items()}, "samples/s (whole epochs, median of rounds)",
              f"DDP, {n} processes", labels={name: f"{median(v):.3f}x plain DDP" for name, v in vs_plain.items()
                                             if median(v)})
    result.plots.append(plot.name)
    return result
