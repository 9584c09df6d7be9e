"""Relaunching a run: one whose training finished finishes what is left in its own dir (or says it is
complete), and one killed before its first checkpoint is marked ``died`` and started again in its dir.

Real processes and SIGKILLs to the whole process group, as when a node is lost.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from src.engine.run.status import DIED, read_fields, read_status
from tests.helpers.config import ROOT
from tests.helpers.training_runs import finish, launch, run_dirs

pytestmark = [pytest.mark.slow, pytest.mark.faults]

TOY = ["model=toy", "data=toy", "trainer.max_epochs=1", "+trainer.limit_train_batches=3", "+trainer.limit_val_batches=1",
       "extras.print_config=false", "logger=csv"]


def train(log_dir: Path, *extra: str, env: dict | None = None):
    return launch([sys.executable, str(ROOT / "src" / "train.py"), *TOY, *extra, f"paths.log_dir={log_dir}"],
                  env=None if env is None else {**os.environ, **env})


def kill_when_status_says(proc, log_dir: Path, text: str, timeout: float = 120) -> Path:
    """SIGKILL every process of the run as soon as its status.yaml contains ``text``; its run dir."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        for run in run_dirs(log_dir):
            status = run / "status.yaml"
            if status.is_file() and text in status.read_text():
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
                return run
        time.sleep(0.002)
    raise AssertionError(f"the run ended before its status said {text!r}: {finish(proc)}")


def test_a_requeued_job_that_finished_training_tests_in_its_own_dir_then_says_it_is_complete(tmp_path):
    job = {"SLURM_JOB_ID": "5151"}
    slow_test = ["test=true", "data.num_test=65536"]  # a test stage long enough to be killed in
    run = kill_when_status_says(train(tmp_path, *slow_test, env=job), tmp_path, "testing")
    trained = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
    assert read_status(run) == DIED  # killed while testing: its process is gone

    requeued = train(tmp_path, *slow_test, env=job)  # SLURM runs the same script again, same job id
    assert finish(requeued) == 0, requeued.stderr_text[-3000:]
    assert run_dirs(tmp_path) == [run], "the requeued job must finish in its own dir"
    log = (run / "train.log").read_text()
    assert f"Training had already finished at step {trained}" in log  # nothing trained again
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == trained
    fields = read_fields(run)
    assert fields["status"] == "finished" and "test/loss" in fields["metrics"]

    again = train(tmp_path, *slow_test, env=job)  # requeued once more after it finished
    assert finish(again) == 0, again.stderr_text[-3000:]
    assert run_dirs(tmp_path) == [run]
    assert "This run already finished" in (run / "train.log").read_text()
    assert read_fields(run)["metrics"] == fields["metrics"]


def test_a_run_killed_before_its_first_checkpoint_is_marked_died_and_restarted_in_its_dir(tmp_path):
    long_epoch = ["++trainer.limit_train_batches=200", "test=false"]  # its first checkpoint comes at the epoch's end
    run = kill_when_status_says(train(tmp_path, *long_epoch), tmp_path, "status: running")
    assert not (run / "checkpoints" / "last.ckpt").exists()
    assert read_status(run) == DIED

    again = train(tmp_path, *long_epoch)  # the same command: it takes the dead run's dir
    assert finish(again) == 0, again.stderr_text[-3000:]
    assert run_dirs(tmp_path) == [run]
    assert read_status(run) == "finished"
