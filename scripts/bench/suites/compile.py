"""torch.compile for long runs: its one-off cost, its per-step gain, and the epoch at which it breaks even.

Two contenders, alternated: ``python src/train.py`` as is (eager) and with ``model.compile=true``
(``nn.Module.compile`` of the net, inductor). The compile cost is the compiled run's first epoch
minus the eager run's first epoch in the same round (the first steps of a compiled run trace and
build kernels). The gain is the steady training-loop time per step after the first epoch. The break-even
point, in whole epochs of the data set, is cost / (gain per step x steps per epoch); if compiled steps
are not faster, it never breaks even.
"""

from __future__ import annotations

from scripts.bench import contenders, measure
from scripts.bench.context import Bench, SuiteResult, headline, median, per_round, same_round, spread

TRAIN_SAMPLES = 55_000  # Fashion-MNIST's training split (the default data.val_size holds out 5,000)


def first_epoch_s(run: measure.Run) -> float:
    epoch = run.timelines[0]["epochs"][0]
    return epoch["steps"][-1] - epoch["start"]


def step_ms(run: measure.Run, batch: int) -> float:
    """Steady training-loop milliseconds per step of ``batch`` samples (epochs after the first)."""
    return 1000.0 * batch / measure.loop_throughput(run)


def run(bench: Bench) -> SuiteResult:
    s = bench.settings
    work = contenders.Work(epochs=s.epochs, limit_train_batches=s.limit_train_batches, batch_size=s.batch_size,
                           **s.on_device())
    makers = {
        "eager": lambda prefix, run_dir: contenders.project(work, prefix, run_dir),
        "compiled": lambda prefix, run_dir: contenders.project(work, prefix, run_dir, "model.compile=true"),
    }
    runs: dict[str, list[measure.Run]] = {name: [] for name in makers}
    for r in range(s.rounds):
        print(f" round {r + 1}/{s.rounds}", flush=True)
        for name, make in makers.items():
            runs[name].append(bench.run(f"compile-{name}-r{r}", make))

    first = {n: per_round(runs[n], first_epoch_s) for n in makers}
    step = {n: per_round(runs[n], lambda run: step_ms(run, work.global_batch)) for n in makers}
    steps_per_epoch = TRAIN_SAMPLES // work.global_batch  # the loader drops the last partial batch
    cost = same_round(first["compiled"], first["eager"], lambda a, b: a - b if a and b else None)
    gain = same_round(step["eager"], step["compiled"], lambda a, b: a - b if a and b else None)
    speedup = same_round(step["eager"], step["compiled"])

    def break_even(c: float | None, g: float | None) -> float | None:
        return c / (g / 1000.0 * steps_per_epoch) if c is not None and g and g > 0 else None

    epochs = [break_even(c, g) for c, g in zip(cost, gain, strict=True)]
    result = SuiteResult("compile", f"torch.compile (model.compile=true) vs eager, {s.device_label()}")
    result.columns = ["contender", "first epoch s", "steady ms/step", "step speedup vs eager"]
    for n in makers:
        result.rows.append([n, spread(first[n]), spread(step[n]),
                            headline(speedup, "{:.3f}") if n == "compiled" else "1.000x"])
    never = sum(1 for c, g in zip(cost, gain, strict=True) if c is not None and (g is None or g <= 0))
    result.notes.append(
        f"Compile cost (compiled first epoch - eager first epoch, same round): {headline(cost, '{:+.1f}', ' s')}. "
        f"Gain per step: {headline(gain, '{:+.3f}', ' ms')}. Break-even after "
        f"{headline(epochs, '{:.1f}', ' epochs')} of {steps_per_epoch} steps"
        + (f"; in {never} round(s) compiled steps were not faster, so it never breaks even there." if never else ".")
        + f" {s.rounds} rounds, {s.epochs} epochs of {s.limit_train_batches or 'all'} steps each.")
    result.notes.append(bench.noise_note([r for v in runs.values() for r in v]))
    result.raw = {"first_epoch_s": first, "step_ms": step, "compile_cost_s": cost, "gain_ms_per_step": gain,
                  "break_even_epochs": epochs, "median_break_even_epochs": median(epochs)}
    return result
