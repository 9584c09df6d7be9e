"""k-fold cross-validation: disjoint, covering, stratified folds; one command runs every fold and writes
``cv.yaml`` from the folds' own results."""

from __future__ import annotations

import csv
import os
import signal
import statistics
import sys
import time

import pytest
import torch
import yaml

from src.data.toy_datamodule import ToyDataModule
from src.engine.data.folds import check_fold, stratified_folds
from src.engine.run.lock import try_lock
from src.engine.search.cross_validation import CV_LOCK, same_command
from src.engine.utils.errors import ConfigError
from tests.helpers.config import ROOT
from tests.helpers.entry import run_entry
from tests.helpers.training_runs import finish, launch


@pytest.mark.fast
def test_folds_are_disjoint_cover_the_split_and_keep_each_class_share():
    targets = torch.randint(0, 10, (1003,), generator=torch.Generator().manual_seed(0))
    folds = stratified_folds(targets, 5, seed=7)
    assert torch.equal(torch.cat(folds).sort().values, torch.arange(1003))  # disjoint and covering
    assert max(map(len, folds)) - min(map(len, folds)) <= 1
    for c in range(10):
        shares = [int((targets[f] == c).sum()) for f in folds]
        assert max(shares) - min(shares) <= 1, (c, shares)
    assert all(torch.equal(a, b) for a, b in zip(folds, stratified_folds(targets, 5, seed=7), strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(folds, stratified_folds(targets, 5, seed=8), strict=True))


@pytest.mark.fast
@pytest.mark.parametrize(("n_folds", "fold", "says"), [(1, 0, "n_folds=1 must be an integer >= 2"),
                                                        (3, 3, "fold=3 must be an integer in 0..2")])
def test_a_fold_outside_the_folds_is_one_line(n_folds, fold, says):
    with pytest.raises(ConfigError, match=says + ".*; fix: "):
        check_fold(n_folds, fold)


@pytest.mark.fast
def test_fold_i_validates_and_the_others_train():
    splits = []
    for fold in range(3):
        dm = ToyDataModule(n_folds=3, fold=fold)
        dm.setup()
        splits.append(dm)
    whole = len(splits[0].data_train) + len(splits[0].data_val)
    val_rows = torch.cat([dm.data_val.inputs for dm in splits])
    assert len(val_rows) == whole == 4096  # every training sample validates exactly once
    assert torch.unique(val_rows, dim=0).shape[0] == whole
    for dm in splits:  # no sample both trains and validates
        both = torch.cat([dm.data_train.inputs, dm.data_val.inputs])
        assert torch.unique(both, dim=0).shape[0] == whole


@pytest.mark.slow
def test_one_command_runs_every_fold_and_cv_yaml_agrees_with_their_logs(tmp_path):
    proc = run_entry("train", "hparams_search=kfold", "model=toy", "data=toy", "data.n_folds=3",  # folds 0, 1, 2
                     "trainer.max_epochs=1", "+trainer.limit_train_batches=5", "test=false", f"paths.log_dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    cv_file = tmp_path / "train" / "cross_validation" / "kfold" / "cv.yaml"
    cv = yaml.safe_load(cv_file.read_text())
    assert cv["metric"] == "val/loss" and cv["n_folds"] == 3 and cv["completed"] == 3
    logged = {}
    for job in sorted(cv_file.parent.glob("[0-9]*")):
        fold = yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text())
        (fold,) = [int(o.split("=")[1]) for o in fold if o.startswith("data.fold=")]
        with open(next(job.glob("csv/*/metrics.csv"))) as f:
            logged[fold] = [float(r["val/loss"]) for r in csv.DictReader(f) if r["val/loss"]][-1]
    assert cv["folds"] == pytest.approx(logged) and len(set(logged.values())) == 3
    assert cv["mean"] == pytest.approx(statistics.fmean(logged.values()))
    assert cv["std"] == pytest.approx(statistics.stdev(logged.values()))
    assert "[cv] val/loss over 3 of 3 folds" in proc.stdout


def test_folds_outside_n_folds_are_refused_before_any_fold_trains(tmp_path):
    proc = run_entry("train", "hparams_search=kfold", "model=toy", "data=toy", "data.n_folds=3", "data.fold=0,1,2,3",
                     "test=false", f"paths.log_dir={tmp_path}")
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and errors == ["error: data.fold takes 3, outside the folds of data.n_folds=3; fix: "
                                               "sweep data.fold=range(3) (the default), or a subset of it"], proc.stderr
    assert not (tmp_path / "train" / "cross_validation" / "kfold").exists()  # no fold ran, nothing was recorded


@pytest.mark.fast
def test_the_same_overrides_in_another_order_continue_a_cross_validation():
    started = ["data.n_folds=2", "data.fold=0,1", "model=toy"]
    assert same_command(started, ["model=toy", "data.fold=0,1", "data.n_folds=2"])
    assert not same_command(started, ["data.n_folds=3", "data.fold=0,1", "model=toy"])
    assert not same_command(["seed=1", "seed=2"], ["seed=2", "seed=1"])  # the last of a key wins: order matters


def trained(job):
    """What a fold's training left: its status and its logged metrics."""
    return (job / "status.yaml").read_text(), next(job.glob("csv/*/metrics.csv")).read_text()


KFOLD = ["hparams_search=kfold", "model=toy", "data=toy", "data.n_folds=3", "data.fold=0,1,2", "test=false"]


@pytest.mark.slow
@pytest.mark.faults
def test_a_killed_cross_validation_continues_its_folds(tmp_path):
    """SIGKILL the k-fold command while fold 1 trains. While another process holds the cross-validation, the
    same command is refused in one line and touches no fold. Then it trains fold 0 no more, resumes fold 1 from
    its last.ckpt, runs fold 2, and cv.yaml holds all three; another command there is refused."""
    command = [*KFOLD, "trainer.max_epochs=40", "+trainer.limit_train_batches=5", f"paths.log_dir={tmp_path}"]
    sweep = tmp_path / "train" / "cross_validation" / "kfold"
    proc = launch([sys.executable, str(ROOT / "src" / "train.py"), *command])
    deadline = time.monotonic() + 240
    while not ((sweep / "1" / "checkpoints" / "last.ckpt").is_file() and not (sweep / "1" / "result.yaml").exists()):
        assert proc.poll() is None and time.monotonic() < deadline, "fold 1 was not caught mid-training"
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    finish(proc)
    fold_0, fold_1 = trained(sweep / "0"), (sweep / "1" / "checkpoints" / "last.ckpt").read_bytes()

    held = try_lock(sweep / CV_LOCK)  # as a process still running this cross-validation would hold it
    try:
        busy = run_entry("train", *command)
    finally:
        os.close(held)
    assert busy.returncode == 2 and busy.stderr.strip().splitlines()[-1].startswith(
        f"error: another process is running the cross-validation in {sweep}"), busy.stderr[-3000:]
    assert (sweep / "1" / "checkpoints" / "last.ckpt").read_bytes() == fold_1 and not (sweep / "2").exists()

    again = run_entry("train", *command)
    assert again.returncode == 0, again.stderr[-3000:]
    assert trained(sweep / "0") == fold_0
    assert "This run already finished" in (sweep / "0" / "train.log").read_text()
    assert f"Resuming this run from {sweep / '1' / 'checkpoints' / 'last.ckpt'}" in (sweep / "1" / "train.log").read_text()
    assert sorted(p.name for p in sweep.iterdir() if p.name.isdigit()) == ["0", "1", "2"]
    with open(next((sweep / "1").glob("csv/*/metrics.csv"))) as f:
        epochs = [int(r["epoch"]) for r in csv.DictReader(f) if r["val/loss"]]
    assert epochs == list(range(40))  # the resumed fold validated each epoch once
    cv = yaml.safe_load((sweep / "cv.yaml").read_text())
    assert cv["completed"] == 3 and sorted(cv["folds"]) == [0, 1, 2]

    other = run_entry("train", *KFOLD, "trainer.max_epochs=41", "+trainer.limit_train_batches=5",
                      f"paths.log_dir={tmp_path}")
    assert other.returncode == 2 and other.stderr.strip().splitlines()[-1].startswith(
        f"error: the cross-validation in {sweep} was started with other overrides")
    assert yaml.safe_load((sweep / "cv.yaml").read_text()) == cv
