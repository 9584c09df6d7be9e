"""Fashion-MNIST MLP test accuracy and wall time after a fixed number of epochs."""

from __future__ import annotations

from scripts.bench import contenders, measure
from scripts.bench.context import Bench, Goal, SuiteResult

# Published anchors for an MLP on Fashion-MNIST's test set.
ANCHORS = "zalando's benchmark lists an MLP at 0.900; scikit-learn's best MLPClassifier 0.871"
GOAL_EPOCHS, GOAL_ACC = 10, 0.90


def makers_of(work: contenders.Work) -> dict:
    """Contender name -> ``make_cmd(prefix, run_dir)``."""
    return {
        "project (defaults)": lambda prefix, run_dir: contenders.project(work, prefix, run_dir),
        "project experiment=fashion_mnist_mlp": lambda prefix, run_dir: contenders.project(
            work, prefix, run_dir, "experiment=fashion_mnist_mlp", f"trainer.max_epochs={work.epochs}"),
        "plain loop": lambda prefix, run_dir: contenders.plain(work, prefix, run_dir=run_dir),
    }


def run(bench: Bench) -> SuiteResult:
    s = bench.settings
    work = contenders.Work(epochs=s.accuracy_epochs, **s.on_device())
    makers = makers_of(work)
    result = SuiteResult("accuracy", f"Accuracy after {work.epochs} epochs (Fashion-MNIST test set), {s.device_label()}")
    result.columns = ["contender", "test acc", "wall s"]
    accs: dict[str, float | None] = {}
    for name, make in makers.items():
        run = bench.run(f"accuracy-{name.split()[0]}-{len(accs)}", make)
        accs[name] = measure.test_metric(run) if run.ok else None
        result.rows.append([name, f"{accs[name]:.4f}" if accs[name] is not None else "failed", f"{run.wall_s:.1f}"])
        if not run.ok:
            result.notes.append(run.error())
        result.raw[name] = {"test_acc": accs[name], "wall_s": run.wall_s}
    best = max((a for n, a in accs.items() if n.startswith("project") and a is not None), default=None)
    measured = work.epochs == GOAL_EPOCHS and best is not None
    result.goals = [Goal(f"project test acc >= {GOAL_ACC} within {GOAL_EPOCHS} epochs",
                         f"{best:.4f} after {work.epochs} epochs" if best is not None else "-",
                         best >= GOAL_ACC if measured else None)]
    result.raw.update(accelerator=s.accelerator, precision=s.precision, device=s.device)
    result.notes.append(f"Anchors: {ANCHORS}. The project tests the best checkpoint by val/acc; the plain loop "
                        "tests its final weights." + ("" if measured else f" The goal needs {GOAL_EPOCHS} epochs: --full."))
    return result
