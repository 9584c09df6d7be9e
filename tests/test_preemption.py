"""Preemption: SIGTERM or SIGUSR1 saves a resumable checkpoint at a batch every rank agrees on, the job exits
128 + signal (SLURM: requeues itself after SIGUSR1), and re-running the same command finishes with the
weights of an uninterrupted run. Real processes, real signals."""

from __future__ import annotations

import os
import re
import signal
import stat
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from tests.helpers.config import ROOT
from tests.helpers.training_runs import (
    TRAIN,
    differing_weights,
    finish,
    launch,
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
    """With ``callbacks=none``: the stop and the resume come from the entry point, not the callbacks group."""
    proc = start(tmp_path, "callbacks=none")
    signal_once_training(proc, tmp_path, signal.SIGTERM)
    assert finish(proc) == 128 + signal.SIGTERM, proc.stderr_text[-3000:]
    (run_dir,) = run_dirs(tmp_path)
    assert "status: preempted" in status_of(run_dir) and "SIGTERM" in status_of(run_dir)
    stopped_at = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
    assert 0 < stopped_at < 180

    again = start(tmp_path, "callbacks=none")
    assert finish(again) == 0, again.stderr_text[-3000:]
    assert run_dirs(tmp_path) == [run_dir]
    assert "status: finished" in status_of(run_dir)
    assert not differing_weights(one_process_reference, run_dir)


@pytest.fixture
def children_take_sigint():
    """A suite started in the background by a non-interactive shell ignores SIGINT, and a child inherits that
    (its Python then never raises KeyboardInterrupt). Handled here, children start as from a terminal."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_is_recorded_as_interrupted_and_the_same_command_resumes(tmp_path, one_process_reference,
                                                                        children_take_sigint):
    """Ctrl-C (SIGINT): Lightning's own shutdown, exit 1; ``status.yaml`` says ``interrupted`` where it stopped,
    not ``failed``, and the same command resumes from the last periodic ``last.ckpt`` to an uninterrupted
    run's weights."""
    proc = start(tmp_path)
    signal_once_training(proc, tmp_path, signal.SIGINT)
    assert finish(proc) == 1, proc.stderr_text[-3000:]
    (run_dir,) = run_dirs(tmp_path)
    assert re.search(r"status: interrupted\ndetail: \"Ctrl-C \(KeyboardInterrupt\) at epoch \d+, global step \d+\"",
                     status_of(run_dir)), status_of(run_dir)

    again = start(tmp_path)
    assert finish(again) == 0, again.stderr_text[-3000:]
    assert run_dirs(tmp_path) == [run_dir] and "status: finished" in status_of(run_dir)
    assert not differing_weights(one_process_reference, run_dir)


@pytest.mark.parametrize(("strategy", "every_n"), [("ddp", 60), ("fsdp", None)],
                         ids=["ddp-stopped-at-an-epochs-first-batch", "fsdp"])
def test_sigterm_to_one_rank_stops_both_at_one_batch_and_resumes_bit_exact(tmp_path, reference_runs, strategy,
                                                                           every_n):
    """FSDP at the default check interval. DDP with a check every 60 batches (an epoch here): the stop is made
    at the start of epoch 2's first batch, where the checkpoint must not take epoch 1's data position for
    epoch 2's (the resume skipped that whole epoch)."""
    launch = [f"trainer={strategy}", "trainer.devices=2"]
    reference = reference_runs(*launch)
    log_dir = tmp_path / "preempted"
    interval = [f"trainer.strategy.sigterm_check_every_n_batches={every_n}"] if every_n else []
    proc = start(log_dir, *launch, *interval)
    assert wait_for_checkpoint(proc, log_dir)
    (child,) = psutil.Process(proc.pid).children()  # rank 1, started by rank 0
    if every_n:  # noted before batch 60's check, agreed at batch 120's: the first batch of epoch 2
        os.kill(child.pid, signal.SIGTERM)
    else:
        signal_once_training(proc, log_dir, signal.SIGTERM, target_pid=child.pid)
    assert finish(proc) == 128 + signal.SIGTERM, proc.stderr_text[-3000:]
    child.wait(timeout=30)
    (run_dir,) = run_dirs(log_dir)
    assert "status: preempted" in status_of(run_dir)
    stops = re.findall(r"\[rank (\d)\].*SIGTERM: every rank stopped at (epoch \d+, global step \d+)",
                       (run_dir / "train.log").read_text())
    assert sorted(rank for rank, _ in stops) == ["0", "1"] and len({where for _, where in stops}) == 1, stops
    if every_n:
        assert stops[0][1] == "epoch 2, global step 120", stops

    again = start(log_dir, *launch, *interval)  # the same command
    assert finish(again) == 0, again.stderr_text[-3000:]
    assert run_dirs(log_dir) == [run_dir]
    assert not differing_weights(reference, run_dir)


@pytest.mark.parametrize("launch", ["ddp_spawn", "ddp_fork"])
def test_sigterm_to_a_ddp_spawn_parent_alone_stops_its_ranks_and_is_recorded(tmp_path, launch):
    """``kill <parent pid>`` under ddp_spawn: the parent passes the signal on instead of dying at once (which left
    its ranks training on, orphaned, and the run recorded as running). The ranks save and stop at one batch; the
    parent exits 143 and records ``preempted`` at the step they saved. Forked ranks, which inherit the parent's
    handler, stop the same way (they were killed by it, with nothing saved)."""
    proc = start(tmp_path, f"trainer={launch}", "trainer.devices=2", "trainer.strategy.sigterm_check_every_n_batches=1")
    assert wait_for_checkpoint(proc, tmp_path), "the run ended before it wrote a checkpoint"
    ranks = [p for p in psutil.Process(proc.pid).children() if "resource_tracker" not in " ".join(p.cmdline())]
    assert len(ranks) == 2, ranks
    os.kill(proc.pid, signal.SIGTERM)  # the parent only
    assert finish(proc) == 128 + signal.SIGTERM, proc.stderr_text[-3000:]
    psutil.wait_procs(ranks, timeout=30)
    assert not [r for r in ranks if r.is_running()], "a spawned rank outlived its parent"
    (run_dir,) = run_dirs(tmp_path)
    stops = re.findall(r"\[rank (\d)\].*SIGTERM: every rank stopped at (epoch \d+, global step \d+)",
                       (run_dir / "train.log").read_text())
    assert sorted(rank for rank, _ in stops) == ["0", "1"] and len({where for _, where in stops}) == 1, stops
    assert f"status: preempted\ndetail: \"SIGTERM, last.ckpt saved; exit code 143 at {stops[0][1]} (the ranks' last save)\"" in \
        status_of(run_dir), status_of(run_dir)


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


def test_sigusr1_without_scontrol_saves_and_says_so_in_one_line(tmp_path):
    """A container without SLURM's tools (pyxis/enroot): the requeue cannot happen, the checkpoint is saved."""
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if not (Path(p) / "scontrol").exists())
    env = {**os.environ, "SLURM_JOB_ID": "4343", "PATH": path}
    proc = start(tmp_path, env=env)
    signal_once_training(proc, tmp_path, signal.SIGUSR1)
    assert finish(proc) == 128 + signal.SIGUSR1, proc.stderr_text[-3000:]
    assert "Traceback" not in proc.stderr_text
    (run_dir,) = run_dirs(tmp_path)
    log = (run_dir / "train.log").read_text()
    lines = [line for line in log.splitlines() if "not requeued" in line]
    assert len(lines) == 1 and "there is no scontrol here" in lines[0] and "last.ckpt is saved" in lines[0], lines
    stopped = re.search(r"SIGUSR1: every rank stopped at epoch \d+, global step (\d+)", log)
    saved = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
    assert stopped and int(stopped[1]) == saved > 0


# -- submitit (hydra/launcher=slurm): a stand-in SLURM that runs the jobs it is given on this machine -----------
STAND_INS = {
    # run the batch script in the background as a new job; print what sbatch prints (submitit parses it)
    "sbatch": 'for a; do script=$a; done\nid=$(( $(cat "$SLURM_STATE/last_id" 2>/dev/null || echo 4300) + 1 ))\n'
              'echo $id > "$SLURM_STATE/last_id"\ncp "$script" "$SLURM_STATE/$id.sbatch"\n'
              'run_job $id >> "$SLURM_STATE/$id.out" 2>&1 &\necho "Submitted batch job $id"\n',
    # one start of job $1 on "a node", as SLURM starts it (again after a requeue)
    "run_job": 'export SLURM_JOB_ID=$1 SLURM_JOB_NODELIST=localhost SLURM_NNODES=1 SLURM_JOB_NUM_NODES=1\n'
               'exec bash "$SLURM_STATE/$1.sbatch"\n',
    # one task: srun's options dropped, the command run as task 0 (its pid kept for the test's signal)
    "srun": 'while [ $# -gt 0 ]; do case $1 in --output|--error) shift 2;; --*) shift;; *) break;; esac; done\n'
            'export SLURM_PROCID=0 SLURM_LOCALID=0 SLURM_NODEID=0 SLURM_NTASKS=1 SLURM_STEP_ID=0\n'
            'echo $$ > "$SLURM_STATE/task.pid"\nexec "$@"\n',
    # requeue: recorded; the job starts again once the process that asked has exited
    "scontrol": 'echo "$@" >> "$SLURM_STATE/scontrol.log"\n[ "$1" = requeue ] || exit 0\nasker=$PPID\n'
                '(while kill -0 $asker 2>/dev/null; do sleep 0.1; done; run_job $2 >> "$SLURM_STATE/$2.out" 2>&1) '
                '> /dev/null 2>&1 &\n',
    "sacct": 'echo "JobID|State|NodeList"\n',  # no state known: submitit waits for the job's result file
}


def stand_in_slurm(folder: Path) -> dict[str, str]:
    (folder / "bin").mkdir(parents=True)
    for name, body in STAND_INS.items():
        tool = folder / "bin" / name
        tool.write_text("#!/bin/sh\n" + body)
        tool.chmod(0o755)
    return {**os.environ, "SLURM_STATE": str(folder), "PATH": f"{folder / 'bin'}{os.pathsep}{os.environ['PATH']}"}


def test_submitit_usr2_saves_at_the_agreed_batch_and_the_requeued_sweep_job_resumes_in_its_dir(tmp_path,
                                                                                                one_process_reference):
    env = stand_in_slurm(tmp_path / "slurm")
    sweep = tmp_path / "sweep"
    proc = launch([sys.executable, str(ROOT / "src" / "train.py"), "-m", "hydra/launcher=slurm", *TRAIN,
                   "hydra.launcher.gpus_per_node=0", f"hydra.sweep.dir={sweep}", f"paths.log_dir={tmp_path / 'logs'}"],
                  env=env)
    job_dir = sweep / "0"
    deadline = time.monotonic() + 180
    while not (job_dir / "checkpoints" / "last.ckpt").is_file() and proc.poll() is None:
        assert time.monotonic() < deadline, "the sweep job wrote no checkpoint"
        time.sleep(0.01)
    time.sleep(0.3)
    os.kill(int((tmp_path / "slurm" / "task.pid").read_text()), signal.SIGUSR2)  # SLURM's --signal=USR2@90

    assert finish(proc) == 0, proc.stderr_text[-3000:]  # the sweep got its job's result: from the requeued job
    assert (tmp_path / "slurm" / "scontrol.log").read_text().split() == ["requeue", "4301"]
    assert [p.name for p in sweep.iterdir() if p.is_dir() and not p.name.startswith(".")] == ["0"]  # one job dir
    log = (job_dir / "train.log").read_text()
    stopped = re.search(r"SIGUSR2: every rank stopped at epoch \d+, global step (\d+)", log)
    assert stopped, log[-3000:]  # saved at the agreed batch, not wherever submitit's handler struck
    assert f"Resuming this run from {job_dir / 'checkpoints' / 'last.ckpt'}" in log
    assert "status: finished" in status_of(job_dir)
    assert not differing_weights(one_process_reference, job_dir)
