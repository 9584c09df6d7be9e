"""Hyper-parameter searches run as a user runs them: Optuna (TPE, optionally resumable), the grid, with DDP.

Each test starts ``python src/train.py hparams_search=...`` and compares the sweep's reported best job
with the metrics the trials themselves logged (their CSV files), not with what the sweep recorded.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from src.utils.hydra_callbacks import registered_ranks
from tests.helpers.entry import run_entry

pytestmark = pytest.mark.slow

TINY = ["trainer.accelerator=cpu", "trainer.max_epochs=1", "++trainer.limit_train_batches=2",
        "++trainer.limit_val_batches=2", "++trainer.limit_test_batches=2", "extras.print_config=false"]


def run_search(tmp_path: Path, *overrides: str, sweep: str = "sweep", timeout: int = 600):
    """``python src/train.py overrides...`` on tiny runs; the sweep in ``tmp_path/sweep``, logs in ``tmp_path/logs``."""
    try:
        proc = run_entry("train", *overrides, *TINY, f"hydra.sweep.dir={tmp_path / sweep}",
                         f"paths.log_dir={tmp_path}/logs", timeout=timeout)
    finally:  # a timed-out sweep leaves its child ranks behind: end them, as `make kill-orphans` would
        for _, rank, orphaned in registered_ranks(tmp_path / "logs" / ".pids"):
            if orphaned:
                rank.kill()
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc, tmp_path / sweep


def logged_best(job_dir: Path, metric: str = "val/acc_best") -> float:
    """The last value of ``metric`` in the trial's own CSV log."""
    with open(job_dir / "csv" / "version_0" / "metrics.csv") as f:
        values = [float(row[metric]) for row in csv.DictReader(f) if row.get(metric)]
    return values[-1]


def job_dirs(sweep: Path) -> list[Path]:
    return sorted((p for p in sweep.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))


def test_optuna_search_reports_the_best_trial(tmp_path):
    """3 TPE trials, started without -m: the reported best is the best of the trials' logged metrics."""
    proc, sweep = run_search(tmp_path, "hparams_search=fashion_mnist_optuna", "hydra.sweeper.n_trials=3")
    jobs = job_dirs(sweep)
    assert [j.name for j in jobs] == ["0", "1", "2"]
    logged = {int(j.name): logged_best(j) for j in jobs}

    best = OmegaConf.load(sweep / "best.yaml")
    assert best.metric == "val/acc_best" and best.mode == "max" and best.jobs == 3 and best.completed == 3
    assert best.value == pytest.approx(max(logged.values()), abs=1e-7)
    assert logged[best.job] == pytest.approx(best.value, abs=1e-7)
    plugin = OmegaConf.load(sweep / "optimization_results.yaml")  # the Optuna study's own verdict
    assert plugin.best_value == pytest.approx(best.value, abs=1e-7)
    trial = OmegaConf.load(jobs[best.job] / ".hydra" / "overrides.yaml")
    for name, value in plugin.best_params.items():  # the best trial's overrides are the study's best params
        assert f"{name}={value}" in trial and f"{name}={value}" in best.swept
    assert f"[sweep] best of 3 jobs: job {best.job}" in proc.stdout
    assert not (tmp_path / "logs" / "train").exists()  # a multirun by itself: no single-run dir


def test_optuna_search_with_ddp(tmp_path):
    """2 trials with trainer=ddp trainer.devices=2: each trial's two ranks stay in that trial's dir."""
    proc, sweep = run_search(tmp_path, "hparams_search=fashion_mnist_optuna", "hydra.sweeper.n_trials=2",
                             "trainer=ddp", "trainer.devices=2", timeout=300)
    jobs = job_dirs(sweep)
    assert [j.name for j in jobs] == ["0", "1"]
    for job in jobs:
        assert (job / "checkpoints" / "last.ckpt").is_file()
        log = (job / "train.log").read_text()
        assert "[rank 0]" in log and "[rank 1]" in log  # both ranks of this trial logged here
    output = proc.stdout + proc.stderr
    assert output.count("Study name:") == 1  # no child rank replayed the search
    assert output.count("Initializing distributed: GLOBAL_RANK: 1") == 2  # one rank-1 child per trial
    assert not (tmp_path / "logs" / "train").exists()  # no child rank started runs of its own
    best = OmegaConf.load(sweep / "best.yaml")
    assert best.value == pytest.approx(max(logged_best(j) for j in jobs), abs=1e-7)


def test_optuna_study_in_sqlite_resumes(tmp_path):
    """hydra/sweeper/storage=sqlite: a second run of the same command continues the stored study."""
    import optuna

    search = ["hparams_search=fashion_mnist_optuna", "hydra/sweeper/storage=sqlite"]
    run_search(tmp_path, *search, "hydra.sweeper.n_trials=2")
    _, sweep = run_search(tmp_path, *search, "hydra.sweeper.n_trials=1", sweep="again")
    db = tmp_path / "logs" / "optuna" / "fashion_mnist_mlp.db"
    storage = optuna.storages.RDBStorage(f"sqlite:///{db}", engine_kwargs={"isolation_level": "AUTOCOMMIT"})
    study = optuna.load_study(study_name="fashion_mnist_mlp", storage=storage)
    assert [t.state.name for t in study.trials] == ["COMPLETE"] * 3
    assert OmegaConf.load(sweep / "optimization_results.yaml").best_value == pytest.approx(study.best_value)


def test_grid_search_without_m_is_a_multirun(tmp_path):
    """hparams_search=fashion_mnist_lr without -m sweeps (hydra.mode: MULTIRUN) and records the best job."""
    # command-line sweeps replace the config's grid (3 x 2) with a 2-job one
    proc, sweep = run_search(tmp_path, "hparams_search=fashion_mnist_lr", "data.batch_size=64",
                             "model.optimizer.lr=0.001,0.003")
    jobs = job_dirs(sweep)
    assert [j.name for j in jobs] == ["0", "1"]
    logged = [logged_best(j) for j in jobs]
    best = OmegaConf.load(sweep / "best.yaml")
    assert best.value == pytest.approx(max(logged), abs=1e-7) and not math.isnan(best.value)
    assert best.swept == [f"model.optimizer.lr={['0.001', '0.003'][best.job]}"]
    assert "[sweep] best of 2 jobs" in proc.stdout
