"""One run is one series in every logger: kill -9 a run twice, re-run the same command, and its logs hold what
an uninterrupted run's hold.

CSV: every logged row once, the same rows and values (the throughput, ``perf/*``, is a wall-clock figure
and left out). TensorBoard: one ``version_0``, and the scalars TensorBoard reads back (it hides the steps a
resume replays) equal the uninterrupted run's. MLflow (file store): each step once, its value equal. W&B
(offline, every attempt under the run's own id, W&B's own resume): every step, its values equal, the replayed
steps again. metrics.png is drawn from the CSV, whole.
"""

from __future__ import annotations

import csv
import os
import random
import signal
import sys
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest

from src.engine.callbacks.metric_plot import MetricPlot
from src.engine.loggers.resumable import ResumableCSVLogger
from tests.helpers.config import ROOT, compose_cfg
from tests.helpers.training_runs import finish, launch, run_dirs, wait_for_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.faults]

# The deterministic MLP (dropout, augmentation), 3 epochs of 30 batches, last.ckpt every 7 steps: resumes land
# mid-epoch, where the epoch's running loss and accuracy must carry over. The learning rate is logged every
# step, so each resume replays points every logger already holds.
LOGS = ["model=mlp", "data=fashion_mnist", "data.augment=true", "trainer.max_epochs=3", "+trainer.limit_train_batches=30",
        "+trainer.limit_val_batches=3", "test=false", "extras.print_config=false",
        "last_ckpt_every_n_train_steps=7", "logger=[csv,tensorboard,mlflow,wandb]",
        "callbacks.lr_monitor.logging_interval=step", "trainer.log_every_n_steps=1"]


# W&B writes its transaction log every WANDB_FLUSH_S (15 s by default): a kill loses what it had not written.
# Here it writes often enough that a kill, KILL_AFTER_SAVE_S after an attempt's first save, finds the saved
# steps held; and each kill lands well before the run's end (a kill after it would start a new run).
WANDB_FLUSH_S, KILL_AFTER_SAVE_S = 0.02, (0.1, 0.3)


def train(log_dir: Path):
    return launch([sys.executable, str(ROOT / "src" / "train.py"), *LOGS, f"paths.log_dir={log_dir}",
                   f"logger.mlflow.tracking_uri=file:{log_dir}/mlflow"],
                  env={**os.environ, "WANDB_SILENT": "true", "WANDB_X_TRANSACTION_LOG_FLUSH_INTERVAL": str(WANDB_FLUSH_S)})


def csv_rows(run: Path) -> list[dict[str, str]]:
    (path,) = run.glob("csv/*/metrics.csv")
    with open(path, newline="") as f:
        return [{k: v for k, v in row.items() if v and not k.startswith("perf/")} for row in csv.DictReader(f)]


def tensorboard_scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (version,) = (run / "tensorboard").iterdir()
    events = EventAccumulator(str(version))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
            if not tag.startswith("perf/")}


def mlflow_metrics(log_dir: Path) -> dict[str, dict[int, list[float]]]:
    """The one MLflow run's metrics: key -> step -> every value logged at that step (file store)."""
    (run,) = [p.parent for p in (log_dir / "mlflow").glob("*/*/metrics")]
    found: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for path in (run / "metrics").rglob("*"):
        key = str(path.relative_to(run / "metrics"))
        if path.is_file() and not key.startswith("perf/"):
            for line in path.read_text().splitlines():
                _, value, step = line.split()
                found[key][int(step)].append(float(value))
    return {k: dict(v) for k, v in found.items()}


def wandb_metrics(run: Path) -> dict[str, dict[int, list[float]]]:
    """Every attempt's W&B points: key -> step -> every value logged at that step (offline transaction logs)."""
    from tests.helpers.wandb_records import STEP_KEY, history_points, transaction_logs

    found: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for path in transaction_logs(run / "wandb", (run / ".run_id").read_text().strip()):
        for point in history_points(path):
            step = point.pop(STEP_KEY)
            for key, value in point.items():
                if not key.startswith("perf/"):
                    found[key][step].append(value)
    return {k: dict(v) for k, v in found.items()}


def kill_twice_then_finish(log_dir: Path) -> Path:
    rng, kills = random.Random(21), 0
    while True:
        proc = train(log_dir)
        if kills < 2 and wait_for_checkpoint(proc, log_dir):
            time.sleep(rng.uniform(*KILL_AFTER_SAVE_S))
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=60)
                kills += 1
                continue
        assert finish(proc) == 0, proc.stderr_text[-3000:]
        assert kills == 2, "the run finished before both kills landed"
        (run,) = run_dirs(log_dir)
        return run


def test_the_plot_keeps_the_epochs_before_a_resume_without_a_csv_log(tmp_path):
    """With no CSV log to read back, the plot's values come from the run's checkpoint."""
    from src.train import train as train_run

    base = ["model=toy", "data=toy", "logger=tensorboard", "test=false", "++trainer.limit_train_batches=3",
            "++trainer.limit_val_batches=2"]
    _, first = train_run(compose_cfg("train", [*base, "trainer.max_epochs=2"], tmp_path / "first"))
    last = tmp_path / "first" / "checkpoints" / "last.ckpt"
    _, resumed = train_run(compose_cfg("train", [*base, "trainer.max_epochs=3", f"ckpt_path={last}"],
                                       tmp_path / "resumed"))
    (before,), (after,) = ([c for c in run["callbacks"] if isinstance(c, MetricPlot)] for run in (first, resumed))
    assert set(after.seen["train/loss"]) == {0, 1, 2} and set(after.seen["val/loss"]) == {0, 1, 2}
    assert {e: after.seen["val/loss"][e] for e in (0, 1)} == before.seen["val/loss"]
    assert (tmp_path / "resumed" / "metrics.png").is_file()


def test_every_logger_continues_one_series_across_kills(tmp_path):
    reference = train(tmp_path / "reference")
    assert finish(reference) == 0, reference.stderr_text[-3000:]
    (expected,) = run_dirs(tmp_path / "reference")
    run = kill_twice_then_finish(tmp_path / "killed")

    assert [p.name for p in (run / "csv").iterdir()] == ["version_0"]
    assert csv_rows(run) == csv_rows(expected)

    plot = MetricPlot()
    logged = {p: plot.logged(SimpleNamespace(loggers=[ResumableCSVLogger(str(p))])) for p in (run, expected)}
    assert logged[run] == logged[expected] and set(logged[run]["train/loss"]) == {0, 1, 2}  # the whole run
    assert (run / "metrics.png").is_file()

    assert [p.name for p in (run / "tensorboard").iterdir()] == ["version_0"]
    assert len(list((run / "tensorboard" / "version_0").glob("events.out.tfevents.*"))) == 3  # one per attempt
    assert tensorboard_scalars(run) == tensorboard_scalars(expected)

    got, want = mlflow_metrics(tmp_path / "killed"), mlflow_metrics(tmp_path / "reference")
    assert got.keys() == want.keys()
    for key in want:  # every step once, with the uninterrupted run's value: a replayed point is not sent again
        assert got[key] == want[key], key

    run_id = (run / ".run_id").read_text().strip()
    attempts = sorted((run / "wandb").glob("offline-run-*"))
    assert len(attempts) == 3 and all(p.name.endswith(f"-{run_id}") for p in attempts)
    got, want = wandb_metrics(run), wandb_metrics(expected)
    assert sorted(want["lr-Adam"]) == list(range(90))  # the reader finds every point of the uninterrupted run
    assert got.keys() == want.keys()
    for key in want:  # every step of the uninterrupted run, its values equal; a replayed step is logged again
        assert got[key].keys() == want[key].keys(), key
        assert all(set(got[key][step]) == set(values) for step, values in want[key].items()), key
