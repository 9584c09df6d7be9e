"""DDP: the project's ``trainer=ddp`` vs a plain torch DDP script vs one process, same global batch."""

from __future__ import annotations

from scripts.bench import contenders, measure
from scripts.bench.context import Bench, Goal, SuiteResult, best, median, per_round, ratio, show, spread
from scripts.bench.report import bar_chart


def run(bench: Bench) -> SuiteResult:
    s = bench.settings
    n = s.nproc
    work = contenders.Work(epochs=s.epochs, limit_train_batches=s.limit_train_batches, batch_size=s.batch_size)
    threads_per_rank = max(1, s.threads // n)
    makers = {  # name -> (command builder, ranks, threads per process)
        f"project ddp x{n}": (lambda prefix, run_dir: contenders.project_ddp(work, prefix, run_dir, n), n, threads_per_rank),
        f"plain DDP x{n}": (lambda prefix, run_dir: contenders.plain_ddp(work, prefix, n), n, threads_per_rank),
        "project 1 process": (lambda prefix, run_dir: contenders.project(work, prefix, run_dir), 1, s.threads),
    }
    runs: dict[str, list[measure.Run]] = {name: [] for name in makers}
    for r in range(s.rounds):
        print(f" round {r + 1}/{s.rounds}", flush=True)
        for name, (make, ranks, threads) in makers.items():
            runs[name].append(bench.run(f"ddp-{name.replace(' ', '-')}-r{r}", make, world_size=ranks, threads=threads))

    steady = {name: per_round(runs[name], measure.steady_throughput) for name in makers}
    overall = {name: per_round(runs[name], lambda run: measure.train_samples(run) / run.wall_s) for name in makers}
    project, plain = f"project ddp x{n}", f"plain DDP x{n}"
    top = {name: best(v) for name, v in steady.items()}
    result = SuiteResult("ddp", f"DDP, {n} processes on gloo (global batch {work.global_batch})")
    result.columns = ["contender", "threads/rank", "samples/s steady (best)", "vs plain DDP", "steady median (min-max)",
                      "samples/s incl. start-up",
                      "to first step s", "peak RSS MiB per rank"]
    for name in makers:
        ok = result.successful(name, runs[name])
        if not ok:
            continue
        rss = [measure.peak_rss_mb(run) for run in ok]
        result.rows.append([
            name, str(measure.threads(ok[0])[0]), show(top[name], "{:,.0f}"), show(ratio(top[name], top[plain]), "{:.3f}x"),
            spread(steady[name]), spread(overall[name]),
            spread(per_round(runs[name], measure.first_step_s)),
            " / ".join(f"{median([r[i] for r in rss]):,.0f}" for i in range(len(rss[0]))),
        ])
    vs_plain = ratio(top[project], top[plain])
    result.goals = [Goal(f"project ddp >= 0.97x plain DDP script (steady state, {n} ranks)",
                         show(vs_plain, "{:.3f}x"), vs_plain >= 0.97 if vs_plain else None)]
    result.notes.append(
        f"Each rank trains {work.global_batch // n} samples per step ({threads_per_rank} torch thread(s) per rank, "
        f"{n} ranks on {s.threads} cores); 'incl. start-up' divides all trained samples by the launch-to-exit wall "
        "time (which also holds validation and test). Steady state as in the throughput suite; ratios compare best rounds.")
    if (s.accelerator, s.precision) != ("cpu", "32-true"):
        result.notes.append(f"--accelerator {s.accelerator} --precision {s.precision} do not apply here: this suite "
                            "compares CPU ranks on gloo in 32-true (the project gets trainer.accelerator=cpu).")
    result.notes.append(bench.noise_note([run for v in runs.values() for run in v]))
    result.raw = {"steady": steady, "overall": overall,
                  "other_load": {name: per_round(runs[name], lambda run: run.other_load) for name in makers},
                  "peak_rss_mb": {name: per_round(runs[name], measure.peak_rss_mb) for name in makers}}
    plot = bench.out / "ddp.png"
    bar_chart(plot, {name: v or 0 for name, v in top.items()}, "samples/s (steady state, best round)",
              f"DDP, {n} processes", reference=plain)
    result.plots.append(plot.name)
    return result
