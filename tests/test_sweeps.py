"""Hyper-parameter searches run as a user runs them: Optuna (pruned, parallel, resumed, with DDP), the grid.

Each test starts ``python src/train.py hparams_search=...`` and checks the search against what the trials
themselves logged (their CSV files, status.yaml) and against the Optuna study in the sweep dir.
"""

from __future__ import annotations

import csv
import datetime as dt
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from src.engine.run.pid_file import registered_ranks
from tests.helpers.config import ROOT
from tests.helpers.docs import assert_no_error_line, docs_command
from tests.helpers.entry import run_entry
from tests.helpers.processes import Processes

TINY = ["trainer.accelerator=cpu", "trainer.max_epochs=1", "++trainer.limit_train_batches=2",
        "++trainer.limit_val_batches=2", "++trainer.limit_test_batches=2", "extras.print_config=false"]
OPTUNA = "hparams_search=fashion_mnist_optuna"
QUICK = ["~callbacks.metric_plot", "++trainer.num_sanity_val_steps=0"]  # for searches of many trials


def search_command(tmp_path: Path, *overrides: str, sweep: str = "sweep") -> list[str]:
    """The overrides of a tiny search (``overrides`` after the tiny settings: they win)."""
    return [*TINY, *overrides, f"hydra.sweep.dir={tmp_path / sweep}", f"paths.log_dir={tmp_path}/logs"]


def docs_search(start: str) -> tuple[list[str], str]:
    """The overrides of the docs' search command that starts with ``start``, and its study's name. The test that
    calls this runs that docs command (tests/test_readme_commands.py)."""
    overrides = shlex.split(docs_command(start))[2:]  # after `python src/train.py`
    names = [o.split("=", 1)[1] for o in overrides if o.startswith("hydra.sweeper.study_name=")]
    return overrides, names[-1] if names else "fashion_mnist_mlp"


def run_search(tmp_path: Path, *overrides: str, sweep: str = "sweep", timeout: int = 600):
    """``python src/train.py overrides...`` tiny: the sweep in ``tmp_path/sweep``, logs in ``tmp_path/logs``."""
    try:
        proc = run_entry("train", *search_command(tmp_path, *overrides, sweep=sweep), timeout=timeout)
    finally:  # a timed-out sweep leaves its child ranks behind: end them, as `make kill-orphans` would
        for _, rank, orphaned in registered_ranks(tmp_path / "logs" / ".pids"):
            if orphaned:
                rank.kill()
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc, tmp_path / sweep


def logged(job_dir: Path, metric: str = "val/acc_best") -> list[tuple[int, float]]:
    """``(epoch, value)`` of every row of the trial's own CSV log that has ``metric``."""
    with open(job_dir / "csv" / "version_0" / "metrics.csv") as f:
        return [(int(row["epoch"]), float(row[metric])) for row in csv.DictReader(f) if row.get(metric)]


def logged_best(job_dir: Path, metric: str = "val/acc_best") -> float:
    return logged(job_dir, metric)[-1][1]


def epochs_run(job_dir: Path) -> int:
    return len({epoch for epoch, _ in logged(job_dir, "val/acc")})


def job_dirs(sweep: Path) -> list[Path]:
    return sorted((p for p in sweep.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))


def study_in(sweep: Path, journal: Path | None = None, name: str = "fashion_mnist_mlp"):
    """The search's Optuna study, read from its journal file (in the sweep dir unless given)."""
    import optuna

    path = str(journal or sweep / "optuna.journal")
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(path))
    return optuna.load_study(study_name=name, storage=storage)


@pytest.mark.fast
def test_search_space_in_hydra_grammar_becomes_optuna_distributions():
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    from src.engine.search.study import search_space, trial_overrides

    fixed, space = search_space({"lr": "tag(log, interval(0.0001, 0.01))", "width": "choice('[256,128]', '[64]')",
                                 "layers": "range(1, 7, 2)"}, ["seed=3", "trainer=cpu", "width=choice(8, 16)"])
    assert fixed == ["seed=3", "trainer=cpu"]
    assert space == {"lr": FloatDistribution(0.0001, 0.01, log=True), "width": CategoricalDistribution([8, 16]),
                     "layers": IntDistribution(1, 5, step=2)}  # the command line wins over the config's params
    assert trial_overrides(fixed, {"lr": 0.001, "width": 8}, seed=7) == ["trainer=cpu", "lr=0.001", "width=8", "seed=7"]


@pytest.mark.slow
def test_optuna_search_reports_the_best_trial(tmp_path):
    """3 TPE trials in SQLite, started without -m: the reported best is the best of the trials' logged metrics."""
    import optuna

    proc, sweep = run_search(tmp_path, OPTUNA, "hydra.sweeper.n_trials=3", "hydra/sweeper/storage=sqlite")
    jobs = job_dirs(sweep)
    assert [j.name for j in jobs] == ["0", "1", "2"]
    logged_values = {int(j.name): logged_best(j) for j in jobs}

    best = OmegaConf.load(sweep / "best.yaml")
    assert best.metric == "val/acc_best" and best.mode == "max" and best.jobs == 3 and best.completed == 3
    assert best.value == pytest.approx(max(logged_values.values()), abs=1e-7)
    assert logged_values[best.job] == pytest.approx(best.value, abs=1e-7)
    study = optuna.load_study(study_name="fashion_mnist_mlp", storage=f"sqlite:///{sweep / 'optuna.db'}")
    assert study.best_trial.number == best.job and study.best_value == pytest.approx(best.value, abs=1e-7)
    trial = OmegaConf.load(jobs[best.job] / ".hydra" / "overrides.yaml")
    for name, value in study.best_params.items():  # the best trial's overrides are the study's best params
        assert f"{name}={value}" in trial and f"{name}={value}" in best.swept
    assert f"[sweep] best of 3 jobs: job {best.job}" in proc.stdout
    assert not (tmp_path / "logs" / "train").exists()  # a multirun by itself: no single-run dir


@pytest.mark.slow
def test_pruned_trials_stop_early_and_never_count_as_best(tmp_path):
    """12 trials of 3 epochs, median pruner after 2 trials: pruned ones stop at the epoch they were pruned,
    say so in status.yaml and result.yaml, and best.yaml is the best *completed* trial."""
    epochs = 3
    proc, sweep = run_search(tmp_path, OPTUNA, "hydra.sweeper.n_trials=12", "hydra.sweeper.pruner.n_startup_trials=2",
                             f"trainer.max_epochs={epochs}", "test=false", *QUICK, timeout=300)
    jobs = job_dirs(sweep)
    assert [int(j.name) for j in jobs] == list(range(12))
    study = study_in(sweep)
    states = {t.number: t.state.name for t in study.trials}
    pruned = [j for j in jobs if states[int(j.name)] == "PRUNED"]
    completed = [j for j in jobs if states[int(j.name)] == "COMPLETE"]
    assert len(pruned) + len(completed) == 12 and pruned, states

    ran = {int(j.name): epochs_run(j) for j in jobs}
    for job in pruned:
        status, result = OmegaConf.load(job / "status.yaml"), OmegaConf.load(job / "result.yaml")
        assert status.status == "pruned" and result.status == "PRUNED" and result.value is None
        at = int(status.detail.split("pruned at epoch ")[1].split(":")[0])
        assert ran[int(job.name)] == at + 1  # stopped right after the epoch it was pruned at
        assert max(study.trials[int(job.name)].intermediate_values) == at
    assert all(ran[int(j.name)] == epochs for j in completed)
    assert any(ran[int(j.name)] < epochs for j in pruned)  # at least one pruned trial saved epochs
    print(f"epochs run per trial: {ran}; pruned: {sorted(int(j.name) for j in pruned)}")

    best = OmegaConf.load(sweep / "best.yaml")
    assert best.jobs == 12 and best.completed == len(completed) and best.pruned == len(pruned)
    assert best.value == pytest.approx(max(logged_best(j) for j in completed), abs=1e-7)
    assert best.job == study.best_trial.number and states[best.job] == "COMPLETE"
    assert proc.stdout.count("[search] trial ") == 12


@pytest.mark.slow
def test_trials_run_in_parallel_processes(tmp_path):
    """The docs' n_jobs=2 search, 2 trials on CPU: two worker processes run a trial each at the same time, each in
    its dir, with its seed. It is this test that runs that docs command (tests/test_readme_commands.py)."""
    docs, name = docs_search(f"python src/train.py {OPTUNA} hydra.sweeper.n_jobs=")
    proc, sweep = run_search(tmp_path, *docs, "hydra.sweeper.n_trials=2", timeout=300)
    assert_no_error_line(proc.stderr)
    jobs = job_dirs(sweep)
    assert [j.name for j in jobs] == ["0", "1"]
    status = [OmegaConf.load(j / "status.yaml") for j in jobs]
    assert status[0].pid != status[1].pid and all(s.status == "finished" for s in status)  # two processes
    spans = []
    for job in jobs:
        stamps = [line[1:24] for line in (job / "train.log").read_text().splitlines() if line.startswith("[20")]
        spans.append([dt.datetime.strptime(s, "%Y-%m-%d %H:%M:%S,%f") for s in (stamps[0], stamps[-1])])
    assert spans[0][0] < spans[1][1] and spans[1][0] < spans[0][1]  # the two trials overlapped in time
    overrides = [OmegaConf.load(j / "result.yaml").overrides for j in jobs]
    assert "seed=12345" in overrides[0] and "seed=12346" in overrides[1]  # seed + trial number
    lrs = [o for ov in overrides for o in ov if o.startswith("model.optimizer.lr=")]
    assert len(set(lrs)) == 2  # each worker samples with its own seed: no duplicate trials
    assert proc.stdout.count("[search] study") == 1 and proc.stdout.count("[sweep] best of 2 jobs") == 1
    assert {t.state.name for t in study_in(sweep, name=name).trials} == {"COMPLETE"}


def wait_for_a_trial_mid_training(sweep: Path, proc: subprocess.Popen, timeout: float = 240) -> int:
    """The number of a trial (not the first) that has saved a checkpoint and not finished, once there is one."""
    end = time.monotonic() + timeout
    while time.monotonic() < end and proc.poll() is None:
        for job in job_dirs(sweep) if sweep.is_dir() else []:
            saved, ended = (job / "checkpoints" / "last.ckpt").is_file(), (job / "result.yaml").exists()
            if int(job.name) > 0 and saved and not ended:
                return int(job.name)
        time.sleep(0.1)
    raise AssertionError(f"no trial was caught mid-training (search exit code {proc.poll()})")


@pytest.mark.slow
def test_killed_search_resumes_without_repeating_finished_trials(tmp_path):
    """SIGKILL the search while a trial trains; the same command again skips the finished trials, continues the
    killed trial in its own dir from its last.ckpt, and runs the rest: every trial once."""
    search_overrides = [OPTUNA, "hydra.sweeper.n_trials=3", "hydra/sweeper/pruner=none", "trainer.max_epochs=3",
                        "++trainer.limit_train_batches=10", "test=false", *QUICK]
    command = [sys.executable, str(ROOT / "src" / "train.py"), *search_command(tmp_path, *search_overrides)]
    search = subprocess.Popen(command, cwd=ROOT, text=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    sweep = tmp_path / "sweep"
    try:
        killed = wait_for_a_trial_mid_training(sweep, search)
    finally:
        os.killpg(search.pid, signal.SIGKILL)  # the whole search, as a lost node or `kill -9` would
        search.wait()
    finished = {j.name: (j / "result.yaml").read_text() for j in job_dirs(sweep) if (j / "result.yaml").exists()}
    assert sorted(finished) == [str(n) for n in range(killed)]
    logs = {name: (sweep / name / "train.log").read_text() for name in finished}

    proc, _ = run_search(tmp_path, *search_overrides, timeout=300)  # the same command
    assert f"{killed} of 3 trials done, 1 to resume ({killed})" in proc.stdout
    for name, result in finished.items():  # finished trials were not run again
        assert (sweep / name / "result.yaml").read_text() == result
        assert (sweep / name / "train.log").read_text() == logs[name]
    assert f"Resuming this run from {sweep / str(killed) / 'checkpoints' / 'last.ckpt'}" in (
        sweep / str(killed) / "train.log").read_text()
    assert [j.name for j in job_dirs(sweep)] == ["0", "1", "2"]
    assert [(t.number, t.state.name) for t in study_in(sweep).trials] == [(n, "COMPLETE") for n in range(3)]
    assert OmegaConf.load(sweep / "best.yaml").jobs == 3


@pytest.mark.slow
def test_a_search_on_the_cross_validated_mean(tmp_path):
    """hydra.sweeper.cv_folds=2: each trial is two fold jobs with the same sampled parameters, its value is
    the mean of what the folds logged, fold 0 alone reports to the pruner, and best.yaml ranks trials."""
    import statistics

    proc, sweep = run_search(tmp_path, OPTUNA, "hydra.sweeper.n_trials=2", "hydra.sweeper.cv_folds=2", "test=false",
                             *QUICK)
    assert [j.name for j in job_dirs(sweep)] == ["0", "1", "2", "3"]  # trial n, fold i: job 2n + i
    study = study_in(sweep)
    assert [t.state.name for t in study.trials] == ["COMPLETE", "COMPLETE"]
    for trial in study.trials:
        jobs = [sweep / str(2 * trial.number + fold) for fold in (0, 1)]
        overrides = [list(OmegaConf.load(job / ".hydra" / "overrides.yaml")) for job in jobs]
        for fold, job_overrides in enumerate(overrides):
            assert "data.n_folds=2" in job_overrides and f"data.fold={fold}" in job_overrides
            assert all(f"{name}={value}" in job_overrides for name, value in trial.params.items())
        values = [logged_best(job) for job in jobs]
        assert values[0] != values[1]  # the folds validate on other samples
        assert trial.user_attrs["cv_values"] == pytest.approx(values, abs=1e-7)
        assert trial.value == pytest.approx(statistics.fmean(values), abs=1e-7)
        assert trial.intermediate_values == pytest.approx({0: values[0]}, abs=1e-7)  # fold 0's report
    best = OmegaConf.load(sweep / "best.yaml")
    assert best.trials == 2 and best.completed == 2 and best.job == study.best_trial.number
    assert best.value == pytest.approx(study.best_value, abs=1e-7) and "data.fold=0" not in best.overrides
    assert proc.stdout.count("(mean of 2 folds)") == 2 and "[sweep] best of 2 trials: trial " in proc.stdout


@pytest.mark.slow
def test_optuna_search_with_ddp(tmp_path):
    """The docs' search with trainer=ddp trainer.devices=2, 2 trials of 2 epochs: each trial's two ranks stay in
    that trial's dir, and only rank 0 reports to the study (one value per epoch). It is this test that runs that
    docs command (tests/test_readme_commands.py)."""
    docs, name = docs_search(f"python src/train.py {OPTUNA} trainer=ddp ")
    proc, sweep = run_search(tmp_path, *docs, "hydra.sweeper.n_trials=2", "trainer.max_epochs=2", timeout=300)
    assert_no_error_line(proc.stderr)
    jobs = job_dirs(sweep)
    assert [j.name for j in jobs] == ["0", "1"]
    for job in jobs:
        assert (job / "checkpoints" / "last.ckpt").is_file()
        log = (job / "train.log").read_text()
        assert "[rank 0]" in log and "[rank 1]" in log  # both ranks of this trial logged here
    output = proc.stdout + proc.stderr
    assert output.count("[search] study") == 1  # no child rank started a search
    assert output.count("Initializing distributed: GLOBAL_RANK: 1") == 2  # one rank-1 child per trial
    assert not (tmp_path / "logs" / "train").exists()  # no child rank started runs of its own
    for trial, job in zip(study_in(sweep, name=name).trials, jobs, strict=True):
        assert trial.intermediate_values == pytest.approx(dict(logged(job)), abs=1e-7)
    best = OmegaConf.load(sweep / "best.yaml")
    assert best.value == pytest.approx(max(logged_best(j) for j in jobs), abs=1e-7)


@pytest.mark.slow
def test_pruned_ddp_trial_stops_every_rank(tmp_path):
    """A DDP trial that the pruner stops at its first epoch: both ranks stop there and exit cleanly."""
    _, sweep = run_search(tmp_path, OPTUNA, "hydra.sweeper.n_trials=1", "trainer=ddp", "trainer.devices=2",
                          "trainer.max_epochs=3", "hydra/sweeper/pruner=none",  # then a pruner that always prunes:
                          "hydra.sweeper.pruner._target_=optuna.pruners.ThresholdPruner",
                          "+hydra.sweeper.pruner.lower=2", timeout=300)
    [job] = job_dirs(sweep)
    assert OmegaConf.load(job / "status.yaml").status == "pruned" and epochs_run(job) == 1
    assert OmegaConf.load(job / "result.yaml").status == "PRUNED"
    log = (job / "train.log").read_text()
    assert "[rank 1]" in log and "Traceback" not in log
    assert [t.state.name for t in study_in(sweep).trials] == ["PRUNED"]


@pytest.mark.slow
def test_grid_search_without_m_is_a_multirun(tmp_path):
    """hparams_search=fashion_mnist_lr without -m sweeps (hydra.mode: MULTIRUN) and records the best job."""
    # command-line sweeps replace the config's grid (3 x 2) with a 2-job one
    proc, sweep = run_search(tmp_path, "hparams_search=fashion_mnist_lr", "data.batch_size=64",
                             "model.optimizer.lr=0.001,0.003")
    jobs = job_dirs(sweep)
    assert [j.name for j in jobs] == ["0", "1"]
    values = [logged_best(j) for j in jobs]
    best = OmegaConf.load(sweep / "best.yaml")
    assert best.value == pytest.approx(max(values), abs=1e-7) and not math.isnan(best.value)
    assert best.swept == [f"model.optimizer.lr={['0.001', '0.003'][best.job]}"]
    assert "[sweep] best of 2 jobs" in proc.stdout


@pytest.mark.slow
def test_a_study_continues_only_under_the_command_that_started_it(tmp_path):
    """The same study with other task overrides is refused in one line (exit 2): its results would not compare."""
    run_search(tmp_path, OPTUNA, "hydra.sweeper.n_trials=1", "test=false")
    proc = run_entry("train", *search_command(tmp_path, OPTUNA, "hydra.sweeper.n_trials=2", "test=false",
                                              "model.optimizer.weight_decay=0.1"), timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: the search in {tmp_path / 'sweep'} was started "
                                                           "with other overrides (")
    assert "fix: " in proc.stderr and "Traceback" not in proc.stderr
    assert [t.state.name for t in study_in(tmp_path / "sweep").trials] == ["COMPLETE"]


@pytest.mark.slow
@pytest.mark.parametrize("apart_s", [0.0, 3.0], ids=["started-together", "started-apart"])
def test_searches_sharing_one_study_run_each_trial_once(tmp_path, apart_s):
    """Two searches, each with its own sweep dir, on one journal file (as from two machines): every trial of
    the study runs in exactly one of them, and both end cleanly. A running trial belongs to the process
    running it; the other search takes it over only once that owner is gone."""
    journal = tmp_path / "shared.journal"
    overrides = [OPTUNA, "hydra.sweeper.n_trials=4", "test=false", *QUICK,
                 f"hydra.sweeper.storage.log_storage.file_path={journal}"]
    with Processes() as searches:
        for name in ("a", "b"):
            command = [sys.executable, str(ROOT / "src" / "train.py"), *search_command(tmp_path, *overrides, sweep=name)]
            searches.start(f"search {name}", command, log=tmp_path / f"search_{name}.log", cwd=ROOT)
            time.sleep(apart_s)
        codes = searches.wait(300, "both searches to run the study's trials and exit")
        for name, code in codes.items():
            assert code == 0 and "Traceback" not in searches.output(name), searches.report(lines=60)
    ran = [int(job.name) for name in ("a", "b") for job in job_dirs(tmp_path / name) if (job / "result.yaml").exists()]
    assert sorted(ran) == [0, 1, 2, 3], ran  # each trial once, in one search or the other
    study = study_in(tmp_path / "a", journal)
    assert [(t.number, t.state.name) for t in study.trials] == [(n, "COMPLETE") for n in range(4)]
