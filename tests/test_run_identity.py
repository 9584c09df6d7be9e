"""Run identity: one launch is one run directory every rank agrees on; a distinct launch never lands in
another's; a restart of the same launch (torchrun --max-restarts, SLURM requeue) finds its own again."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from lightning.fabric.plugins.environments.lightning import find_free_network_port

from src.engine.run import identity as run_identity
from src.engine.run.lock import try_lock
from src.engine.run.status import FINISHED, RUNNING, write_status
from tests.helpers.config import ROOT
from tests.helpers.entry import run_entry
from tests.helpers.training_runs import (
    TRAIN,
    differing_weights,
    finish,
    launch,
    run_dirs,
    wait_for_checkpoint,
)

TOY = ["model=toy", "data=toy", "trainer.max_epochs=1", "+trainer.limit_train_batches=3",
       "+trainer.limit_val_batches=1", "test=false", "extras.print_config=false"]


@pytest.fixture(autouse=True)
def fresh_choice():
    run_identity.release_run_dirs()
    yield
    run_identity.release_run_dirs()


def clear_launchers(monkeypatch) -> None:
    for name in ("SKYPILOT_TASK_ID", "SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_STEP_ID",
                 "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.fast
def test_same_second_launches_get_distinct_directories(tmp_path, monkeypatch):
    clear_launchers(monkeypatch)
    first = str(run_identity.choose_run_dir(tmp_path, ["a=1"], auto_resume=False))
    second = str(run_identity.choose_run_dir(tmp_path, ["a=1"], auto_resume=False))
    assert first != second and Path(first).is_dir() and Path(second).is_dir()
    assert Path(second).name.startswith(Path(first).name)


@pytest.mark.fast
def test_slurm_job_keeps_its_directory_across_requeues_and_separates_commands(tmp_path, monkeypatch):
    clear_launchers(monkeypatch)
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "77")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    monkeypatch.setenv("SLURM_JOB_ID", "80")
    a = str(run_identity.choose_run_dir(tmp_path, ["model=mlp"]))
    assert str(run_identity.choose_run_dir(tmp_path, ["model=mlp"])) == a
    assert Path(a).name.startswith("slurm_77_3_")
    assert str(run_identity.choose_run_dir(tmp_path, ["model=toy"])) != a  # another training in the same job
    write_status(a, FINISHED)
    # a requeue after the run finished lands in it again (the task then says it is complete) ...
    assert str(run_identity.choose_run_dir(tmp_path, ["model=mlp"])) == a
    # ... unless it asks not to resume: then a fresh dir
    assert str(run_identity.choose_run_dir(tmp_path, ["model=mlp"], auto_resume=False)) == a + "_2"


@pytest.mark.fast
def test_without_auto_resume_a_requeue_starts_beside_the_interrupted_run(tmp_path, monkeypatch):
    clear_launchers(monkeypatch)
    monkeypatch.setenv("SKYPILOT_TASK_ID", "sky-7")
    first = run_identity.choose_run_dir(tmp_path, ["a=1"], auto_resume=False)
    first.mkdir()
    # every rank of the same launch, before any checkpoint: the same dir
    assert run_identity.choose_run_dir(tmp_path, ["a=1"], auto_resume=False) == first
    (first / "checkpoints").mkdir()
    (first / "checkpoints" / "epoch_0.ckpt").write_bytes(b"x")  # then killed: status says running (died)
    write_status(first, RUNNING)
    again = run_identity.choose_run_dir(tmp_path, ["a=1"], auto_resume=False)
    assert again == first.with_name(first.name + "_2"), "a fresh dir, not one the checkpoint check refuses"
    assert run_identity.choose_run_dir(tmp_path, ["a=1"]) == first, "auto_resume still continues the killed run"


@pytest.mark.fast
def test_a_running_unfinished_run_is_not_taken_over(tmp_path, monkeypatch):
    clear_launchers(monkeypatch)
    crashed = tmp_path / "2026-01-01_00-00-00"
    (crashed / "checkpoints").mkdir(parents=True)
    (crashed / "checkpoints" / "last.ckpt").write_bytes(b"x")
    (crashed / ".hydra").mkdir()
    (crashed / ".hydra" / "overrides.yaml").write_text("- a=1\n")
    assert str(run_identity.choose_run_dir(tmp_path, ["a=1"])) == str(crashed)  # re-running the command continues it
    assert run_identity.passed_over_note(crashed) is None
    holder = run_identity._locks.copy()  # this process still holds the lock: a second identical command...
    second = run_identity.choose_run_dir(tmp_path, ["a=1"])
    assert holder and str(second) != str(crashed)  # ...starts its own run, and says why, once
    note = run_identity.passed_over_note(second)
    assert note and str(crashed) in note and str(second) in note and "stop its process" in note
    assert run_identity.passed_over_note(second) is None
    run_identity.release_run_dirs()
    other = run_identity.choose_run_dir(tmp_path, ["a=2"])
    assert str(other) != str(crashed) and run_identity.passed_over_note(other) is None  # other overrides: not this run


@pytest.mark.fast
@pytest.mark.parametrize("child", ["worker", "ddp_fork rank"])
def test_only_a_forked_rank_keeps_the_run_dir_locked(tmp_path, monkeypatch, child):
    """A DataLoader worker, forked while the run dir is locked, can outlive its owner by seconds (the OOM killer
    ends only the biggest process; workers look for their parent every few seconds): the lock must go with the
    owner, or the re-run of the command starts a new run beside the one it should continue. A ``ddp_fork`` rank
    writes into the run dir and would train on without its launcher: it keeps the lock."""
    clear_launchers(monkeypatch)
    run = run_identity.choose_run_dir(tmp_path, ["a=1"])
    (wait, go), (started, says_started) = os.pipe(), os.pipe()
    as_rank = run_identity.shared_with_forked_ranks() if child == "ddp_fork rank" else contextlib.nullcontext()
    with as_rank:
        pid = os.fork()
    if pid == 0:  # the forked child (its fork handlers have run): alive until the parent says
        os.write(says_started, b"x")
        os.read(wait, 1)
        os._exit(0)
    try:
        os.read(started, 1)
        run_identity.release_run_dirs()  # the owner lets go (as its death would)
        fd = try_lock(run / run_identity.LOCK_FILE)
        if fd is not None:
            os.close(fd)
        assert (fd is None) == (child == "ddp_fork rank"), f"a forked {child}: lock held {fd is None}"
    finally:
        os.write(go, b"x")
        os.waitpid(pid, 0)
        for fd in (wait, go, started, says_started):
            os.close(fd)


@pytest.mark.slow
def test_two_commands_started_together_get_their_own_directories(tmp_path):
    procs = [launch([sys.executable, str(ROOT / "src" / "train.py"), *TOY, f"paths.log_dir={tmp_path}"])
             for _ in range(2)]
    assert [finish(p) for p in procs] == [0, 0], [p.stderr_text[-2000:] for p in procs]
    dirs = run_dirs(tmp_path)
    assert len(dirs) == 2
    pids = {d: (d / "status.yaml").read_text().split("pid: ")[1].strip() for d in dirs}
    assert len(set(pids.values())) == 2  # each directory is one process's run, written by it alone
    for d in dirs:
        assert (d / ".hydra" / "config.yaml").is_file() and not list((d / "checkpoints").glob("*-v1.ckpt"))


def torchrun(log_dir: Path, port: int, *extra: str) -> subprocess.Popen:
    return launch([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
                   *extra, str(ROOT / "src" / "train.py"), "trainer=ddp", "trainer.devices=2", *TRAIN,
                   f"paths.log_dir={log_dir}"])


@pytest.mark.slow
@pytest.mark.faults
def test_torchrun_restarts_a_killed_rank_and_resumes_bit_exact_and_a_relaunch_on_the_same_port_is_a_new_run(tmp_path):
    port = find_free_network_port()
    reference = torchrun(tmp_path / "reference", port)
    assert finish(reference) == 0, reference.stderr_text[-3000:]

    log_dir = tmp_path / "restarted"
    proc = torchrun(log_dir, port, "--max-restarts=2")
    assert wait_for_checkpoint(proc, log_dir)
    time.sleep(0.5)
    workers = [p for p in psutil.Process(proc.pid).children(recursive=True) if "src/train.py" in " ".join(p.cmdline())]
    os.kill(workers[-1].pid, signal.SIGKILL)  # one rank dies; the agent restarts the group
    assert finish(proc) == 0, proc.stderr_text[-3000:]
    (run_dir,) = run_dirs(log_dir)  # the restarted ranks found the launch's directory again
    assert "Resuming this run from" in (run_dir / "train.log").read_text()
    assert not differing_weights(run_dirs(tmp_path / "reference")[0], run_dir)

    # the same command on the same port, launched again: a new launch, a new directory (not "already holds")
    again = torchrun(tmp_path / "reference", port)
    assert finish(again) == 0, again.stderr_text[-3000:]
    assert len(run_dirs(tmp_path / "reference")) == 2


@pytest.mark.slow
def test_a_refused_run_leaves_the_earlier_run_untouched(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "epoch_000.ckpt").write_bytes(b"earlier")
    (run / ".hydra").mkdir()
    before = {name: f"earlier {name}" for name in ("config.yaml", "overrides.yaml", "hydra.yaml")}
    for name, text in before.items():
        (run / ".hydra" / name).write_text(text)
    proc = run_entry("train", *TOY, f"hydra.run.dir={run}")
    assert proc.returncode == 2 and "already holds checkpoints" in proc.stderr
    assert {p.name: p.read_text() for p in (run / ".hydra").iterdir()} == before
    assert not (run / "config_tree.log").exists() and not (run / "train.log").exists()
