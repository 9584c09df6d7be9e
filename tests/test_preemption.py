"""Preemption: SIGTERM or SIGUSR1 saves a resumable checkpoint at a batch every rank agrees on, the job exits
128 + signal (SLURM: requeues itself after SIGUSR1), and re-running the same command finishes with the
weights of an uninterrupted run. Real processes, real signals."""

from __future__ import annotations

import os
import re
import signal
import stat
import time
from pathlib import Path

import psutil
import pytest
import torch

from tests.helpers.training_runs import (
    differing_weights,
    finish,
    run_dirs,
    start,
    wait_for_checkpoint,
)

pytestmark = [pytest.mark.slow, pytest.mark.faults]


@pytest.fixture
def one_process_reference(reference_runs) -> Path:
    return reference_runs()


def signal_once_training(proc, log_dir: Path, signum: int, target_pid: int | None = None) -> None:
    assert wait_for_checkpoint(proc, log_dir), "the run ended before it wrote a checkpoint"
    time.sleep(0.3)
    os.kill(target_pid or proc.pid, signum)


def status_of(run_dir: Path) -> str:
    return (run_dir / "status.yaml").read_text()


def test_sigterm_saves_exits_143_and_the_same_command_resumes_bit_exact(tmp_path, one_process_reference):
    proc = start(tmp_path)
    signal_once_training(proc, tmp_path, signal.SIGTERM)
    assert finish(proc) == 128 + signal.SIGTERM, proc.stderr_text[-3000:]
    (run_dir,) = run_dirs(tmp_path)
    assert "status: preempted" in status_of(run_dir) and "SIGTERM" in status_of(run_dir)
    stopped_at = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
    assert 0 < stopped_at < 180

    again = start(tmp_path)
    assert finish(again) == 0, again.stderr_text[-3000:]
    assert run_dirs(tmp_path) == [run_dir]
    assert "status: finished" in status_of(run_dir)
    assert not differing_weights(one_process_reference, run_dir)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_sigterm_to_one_rank_stops_both_at_one_batch_and_resumes_bit_exact(tmp_path, reference_runs, strategy):
    launch = [f"trainer={strategy}", "trainer.devices=2"]
    reference = reference_runs(*launch)
    log_dir = tmp_path / "preempted"
    proc = start(log_dir, *launch)
    assert wait_for_checkpoint(proc, log_dir)
    (child,) = psutil.Process(proc.pid).children()  # rank 1, started by rank 0
    signal_once_training(proc, log_dir, signal.SIGTERM, target_pid=child.pid)
    assert finish(proc) == 128 + signal.SIGTERM, proc.stderr_text[-3000:]
    child.wait(timeout=30)
    (run_dir,) = run_dirs(log_dir)
    assert "status: preempted" in status_of(run_dir)
    stops = re.findall(r"\[rank (\d)\].*SIGTERM: every rank stopped at (epoch \d+, global step \d+)",
                       (run_dir / "train.log").read_text())
    assert sorted(rank for rank, _ in stops) == ["0", "1"] and len({where for _, where in stops}) == 1, stops

    again = start(log_dir, *launch)
    assert finish(again) == 0, again.stderr_text[-3000:]
    assert run_dirs(log_dir) == [run_dir]
    assert not differing_weights(reference, run_dir)


def test_sigusr1_on_slurm_saves_requeues_and_the_requeued_job_resumes_in_its_own_dir(tmp_path, one_process_reference):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"  # records what the job asked SLURM to do
    scontrol.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'scontrol.log'}\n")
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "SLURM_JOB_ID": "4242", "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    log_dir = tmp_path / "logs"

    proc = start(log_dir, env=env)
    signal_once_training(proc, log_dir, signal.SIGUSR1)
    assert finish(proc) == 128 + signal.SIGUSR1, proc.stderr_text[-3000:]
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "4242"]
    (run_dir,) = run_dirs(log_dir)
    assert run_dir.name.startswith("slurm_4242_")
    assert "status: preempted" in status_of(run_dir) and "SIGUSR1" in status_of(run_dir)

    requeued = start(log_dir, env=env)  # SLURM runs the same batch script again, same job id
    assert finish(requeued) == 0, requeued.stderr_text[-3000:]
    assert run_dirs(log_dir) == [run_dir]
    assert not differing_weights(one_process_reference, run_dir)
