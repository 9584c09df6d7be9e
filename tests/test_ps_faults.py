"""``trainer=ps`` under faults, with real processes over gloo on loopback: a worker killed mid-epoch leaves and the
job finishes as planned; a server killed ends the job with one line naming it, and the same command resumes; a
server given SIGTERM stops the job with last.ckpt saved, and the same command resumes; a frozen worker that wakes
and a worker started again with its own command join the running job; a worker stuck in its step does not
outlive the job.

The victim's pid comes from the chief's log (``ps: worker 1, rank 2 (host h, pid 123), joined at step 0``); a
test-only delay per step (:class:`src.engine.callbacks.slow_rank.SlowRank`) keeps the job running while it is hit.
"""

from __future__ import annotations

import csv
import datetime as dt
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from lightning.fabric.plugins.environments.lightning import find_free_network_port

from tests.helpers.config import ROOT
from tests.helpers.multiprocess import run_workers
from tests.helpers.training_runs import finish, launch, run_dirs
from tests.test_ps import SLOW, TOY, train_run

pytestmark = [pytest.mark.slow, pytest.mark.faults]

# The default model and data (Fashion-MNIST MLP, real data) for one epoch of a 192-sample global batch (64 per
# worker): ~0.83 test accuracy, where two async runs differ by well under a point (at a third of an epoch they
# still differ by more).
FASHION = ["trainer.accelerator=cpu", "data.batch_size=192", "trainer.max_epochs=1", "++trainer.limit_val_batches=5", "extras.print_config=false", "callbacks.metric_plot=null", "logger=csv"]
TOY_RUN = [o for o in TOY if not o.startswith("trainer.max_epochs")]
JOINED = re.compile(r"ps: worker (\d+), rank (\d+) \(host \S+, pid (\d+)\), joined")


def command(*overrides: str) -> list[str]:
    return [sys.executable, str(ROOT / "src" / "train.py"), *overrides]


def wait_for_joins(log: Path, count: int, proc: subprocess.Popen, timeout: float = 120) -> dict[int, int]:
    """``{worker: pid}`` once the chief's log shows ``count`` joins (the job is training)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        found = {int(w): int(pid) for w, _, pid in JOINED.findall(log.read_text())} if log.is_file() else {}
        if len(found) >= count:
            return found
        time.sleep(0.05)
    raise AssertionError(f"only {log.read_text().count(' joined') if log.is_file() else 0} of {count} workers joined")


def start_and_find_server_1(args: list[str], log_dir: Path) -> tuple[subprocess.Popen, Path, psutil.Process]:
    """Launch a 2-server job; once its first last.ckpt is written: the launch, its run dir and server 1 (rank 1)."""
    proc = launch(args)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None and not any(
            (d / "checkpoints" / "last.ckpt").is_file() for d in run_dirs(log_dir)):
        time.sleep(0.05)
    (run_dir,) = run_dirs(log_dir)
    server = next(c for c in psutil.Process(proc.pid).children()
                  if "LOCAL_RANK" in c.environ() and c.environ()["LOCAL_RANK"] == "1")
    return proc, run_dir, server


def logged(run_dir: Path, name: str) -> float:
    """The last value of metric ``name`` in the run's CSV log."""
    (metrics,) = run_dir.rglob("metrics.csv")
    values = [row[name] for row in csv.DictReader(metrics.open()) if row.get(name)]
    return float(values[-1])


def test_a_killed_worker_leaves_and_the_job_finishes_as_planned(tmp_path):
    """1 server + 3 workers; kill -9 worker 1 mid-epoch. The job ends with exit 0 after every planned update,
    the chief's log names the worker that left, and test accuracy is no more than 3 points below an undisturbed
    run's."""
    train_run(tmp_path / "undisturbed", "trainer=ps", "trainer.devices=4", *FASHION)
    run_dir = tmp_path / "killed"
    proc = launch(command("trainer=ps", "trainer.devices=4", *FASHION, *SLOW, "+callbacks.slow.delay_s=0.02",
                          f"hydra.run.dir={run_dir}"))
    pids = wait_for_joins(run_dir / "train.log", 3, proc)
    time.sleep(1.0)  # mid-epoch: each worker's ~300 steps take >= 6 s with the delay
    os.kill(pids[1], signal.SIGKILL)
    assert finish(proc, timeout=180) == 0, proc.stderr_text[-3000:]
    log = (run_dir / "train.log").read_text()
    assert re.search(rf"WARNING.*ps: worker 1, rank 2 \(host \S+, pid {pids[1]}\), left: its process is gone", log), log[-3000:]
    assert "left: it finished" in log  # the others carried on to the end
    steps = [torch.load(d / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
             for d in (run_dir, tmp_path / "undisturbed")]
    assert steps[0] == steps[1] > 250, steps  # every planned update, the killed worker's share done by the others
    acc, reference = logged(run_dir, "test/acc"), logged(tmp_path / "undisturbed", "test/acc")
    # A one-sided bound: two workers are less stale than three, so the disturbed run may end better. Asynchronous
    # updates land in a different order on every run, which moves one epoch's accuracy by a point or so either way
    # (figures: docs/parameter-server.md); a lost or half-applied update would cost far more than 3 points.
    assert acc > 0.75 and acc >= reference - 0.03, (acc, reference)


def test_a_killed_server_ends_the_job_in_one_line_and_the_same_command_resumes(tmp_path):
    """2 servers + 2 workers; kill -9 server 1 (rank 1) after a checkpoint. The job exits non-zero with one
    ``error:`` line naming rank 1 and its pid; the same command then resumes from last.ckpt and finishes."""
    args = command("trainer=ps", "trainer.devices=4", "trainer.strategy.num_servers=2", *TOY_RUN, "data.batch_size=32",
                   "trainer.max_epochs=3", "++trainer.limit_train_batches=40", "test=false",
                   "trainer.strategy.link_timeout_s=10", "last_ckpt_every_n_train_steps=5", *SLOW, "+callbacks.slow.delay_s=0.02",
                   f"paths.log_dir={tmp_path}")
    proc, run_dir, server = start_and_find_server_1(args, tmp_path)
    os.kill(server.pid, signal.SIGKILL)
    code = finish(proc, timeout=60)
    assert code != 0
    lines = [line for line in proc.stderr_text.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, proc.stderr_text[-3000:]
    assert re.match(rf"error: server rank 1 \(host \S+, pid {server.pid}\) died", lines[0]), lines[0]
    assert "Traceback" not in proc.stderr_text
    stopped_at = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
    assert 0 < stopped_at < 120
    status = (run_dir / "status.yaml").read_text()  # the chief ends at once too: it says why before it does
    assert "status: failed" in status, status

    again = launch(args)
    assert finish(again, timeout=180) == 0, again.stderr_text[-3000:]
    assert run_dirs(tmp_path) == [run_dir]  # the same run, continued
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 120
    assert "status: finished" in (run_dir / "status.yaml").read_text()


def test_sigterm_to_a_server_saves_and_stops_every_rank_and_the_same_command_resumes(tmp_path):
    """2 servers + 2 workers; SIGTERM to server 1 (rank 1) after a checkpoint. The server asks the chief, which
    saves last.ckpt at its next step; the job exits 143 with status ``preempted``, and the same command resumes
    from there to the planned end. (Lightning's own per-batch stop check needs a process group ps has not got.)"""
    args = command("trainer=ps", "trainer.devices=4", "trainer.strategy.num_servers=2", *TOY_RUN, "data.batch_size=32",
                   "trainer.max_epochs=2", "++trainer.limit_train_batches=40", "test=false",
                   "last_ckpt_every_n_train_steps=5", *SLOW, "+callbacks.slow.delay_s=0.02", "+callbacks.slow.factor=50",
                   "+callbacks.slow.slow_ranks=[3]", f"paths.log_dir={tmp_path}")
    proc, run_dir, server = start_and_find_server_1(args, tmp_path)
    os.kill(server.pid, signal.SIGTERM)
    assert finish(proc, timeout=60) == 128 + signal.SIGTERM, proc.stderr_text[-3000:]
    # worker rank 3, 1 s per step, is mid-step at the stop: the servers wait for its push and tell it the job stopped
    assert "Traceback" not in proc.stderr_text and "error:" not in proc.stderr_text, proc.stderr_text[-3000:]
    status = (run_dir / "status.yaml").read_text()
    assert "status: preempted" in status and "SIGTERM" in status, status
    log = (run_dir / "train.log").read_text()
    assert "SIGTERM: every rank stopped at" in log
    assert log.count("left: it stopped on SIGTERM") == 2, log[-3000:]  # both workers, as the chief's log says
    stopped_at = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
    assert 5 <= stopped_at < 80, stopped_at

    again = launch(args)
    assert finish(again, timeout=180) == 0, again.stderr_text[-3000:]
    assert run_dirs(tmp_path) == [run_dir]
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 80
    assert "status: finished" in (run_dir / "status.yaml").read_text()


def test_a_frozen_worker_that_wakes_joins_again_and_one_that_wakes_after_the_end_exits_quietly(tmp_path):
    """SIGSTOP worker 1 past ``link_timeout_s``: the server drops it (``stopped responding``); SIGCONT, and it
    finds its link closed, reads in the store that this server dropped it (not that it died), and joins again.
    Freeze it once more until the job has ended: woken then, it sees the job finished and exits without an
    error line (not a dead server, and no wait of ``link_timeout_s`` to rejoin a job that is gone)."""
    run_dir = tmp_path / "run"
    proc = launch(command("trainer=ps", "trainer.devices=3", *TOY, "data.batch_size=32", "++trainer.limit_train_batches=80",
                          "test=false", "trainer.strategy.link_timeout_s=4", *SLOW, "+callbacks.slow.delay_s=0.1",
                          f"hydra.run.dir={run_dir}"))
    pids = wait_for_joins(run_dir / "train.log", 2, proc)
    sleeper = psutil.Process(pids[1])

    def log() -> str:
        return (run_dir / "train.log").read_text()

    sleeper.suspend()
    try:
        deadline = time.monotonic() + 60
        while "left: it stopped responding" not in log() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        sleeper.resume()
    while " joined again " not in log() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    sleeper.suspend()  # again, until the job has ended
    try:
        proc.wait(timeout=120)
    finally:
        sleeper.resume()
    sleeper.wait(timeout=30)  # well within link_timeout_s: it does not try to rejoin a job that is gone
    assert finish(proc) == 0, proc.stderr_text[-3000:]  # the stderr file now holds the woken worker's lines too
    assert "error:" not in proc.stderr_text and "another rank failed" not in proc.stderr_text, proc.stderr_text[-3000:]
    text = log()
    assert re.search(rf"worker 1, rank 2 \(host \S+, pid {sleeper.pid}\), left: it stopped responding for 4 s", text), text[-3000:]
    assert re.search(rf"worker 1, rank 2 \(host \S+, pid {sleeper.pid}\), joined again at step \d+", text), text[-3000:]
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 80


def test_a_worker_started_again_with_its_own_command_rejoins(tmp_path):
    """Kill -9 worker 0, then start its process again with the same command line and environment (what a
    supervisor or a re-issued srun step does): the servers log it joining again, and it and the job exit 0.
    Worker 1 is frozen (SIGSTOP) until the restart has joined, so the job cannot end before it on a loaded
    machine; at the end the server answers both workers' last pushes with DONE before it exits."""
    run_dir = tmp_path / "run"
    proc = launch(command("trainer=ps", "trainer.devices=3", *TOY, "data.batch_size=32", "++trainer.limit_train_batches=100",
                          "test=false", *SLOW, "+callbacks.slow.delay_s=0.05", f"hydra.run.dir={run_dir}"))
    pids = wait_for_joins(run_dir / "train.log", 2, proc)
    victim, other = psutil.Process(pids[0]), psutil.Process(pids[1])
    cmdline, env, cwd = victim.cmdline(), victim.environ(), victim.cwd()
    other.suspend()
    try:
        os.kill(victim.pid, signal.SIGKILL)
        restarted = subprocess.Popen(cmdline, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 90  # within the link timeout (120 s): the frozen worker stays a member
        while " joined again " not in (run_dir / "train.log").read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        other.resume()
    _, err = restarted.communicate(timeout=180)
    assert restarted.returncode == 0, err[-3000:]
    assert finish(proc, timeout=60) == 0, proc.stderr_text[-3000:]
    log = (run_dir / "train.log").read_text()
    assert re.search(rf"ps: worker 0, rank 1 \(host \S+, pid {victim.pid}\), left: its process is gone", log), log[-3000:]
    assert re.search(rf"ps: worker 0, rank 1 \(host \S+, pid {restarted.pid}\), joined again at step \d+", log), log[-3000:]
    assert log.count("left: it finished") == 2, log[-3000:]  # both workers got DONE; none saw the server vanish
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 100


def test_a_worker_stuck_in_its_step_is_dropped_and_exits_once_the_job_ended(tmp_path):
    """Worker 1's main thread blocks in a C call (its threads live). The server drops it after ``link_timeout_s``,
    the job ends exit 0 with the other worker, and the stuck process does not outlive the job for long: its end
    watch says so in one line and exits with the job's code (an srun step or torchrun agent would wait for it)."""
    run_dir = tmp_path / "run"
    proc = launch(command("trainer=ps", "trainer.devices=3", *TOY, "data.batch_size=32", "++trainer.limit_train_batches=40",
                          "test=false", "trainer.strategy.link_timeout_s=4", *SLOW, "+callbacks.slow.delay_s=0.05",
                          "+callbacks.stuck._target_=tests.helpers.stuck_rank.StuckRank", "+callbacks.stuck.rank=2",
                          "+callbacks.stuck.at_step=3", "+callbacks.stuck.how=call", f"hydra.run.dir={run_dir}"))
    proc.wait(timeout=120)
    stuck = int((run_dir / "stuck").read_text())
    deadline = time.monotonic() + 30
    while psutil.pid_exists(stuck) and psutil.Process(stuck).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the stuck worker outlived the job by 30 s"
        time.sleep(0.2)
    assert finish(proc) == 0, proc.stderr_text[-3000:]
    assert re.search(r"worker 1, rank 2 \(host \S+, pid \d+\), left: it stopped responding for 4 s", (run_dir / "train.log").read_text())
    assert "rank 2: the job ended (finished) 4 s ago and this worker is still in its step (stuck); it exits now" in proc.stderr_text
    assert "error:" not in proc.stderr_text, proc.stderr_text[-3000:]


def frozen_while_joining(rank: int, world_size: int, port: int, link_timeout_s: float) -> list[str]:
    """Rank 0 serves one worker (rank 1) and freezes it (SIGSTOP) the moment its join is accepted, before the
    answer reaches it; once the server has dropped it as frozen, it wakes it (SIGCONT). The worker then pushes
    once and leaves. Rank 0 returns the server's log lines; rank 1, its incarnations."""
    from src.engine.strategies.ps.client import ServerClient
    from src.engine.strategies.ps.coordination import JobStore
    from src.engine.strategies.ps.serve import ServerLinks
    from src.engine.strategies.ps.server import ParameterServer

    long, link_timeout = dt.timedelta(seconds=60), dt.timedelta(seconds=link_timeout_s)
    jobs = JobStore(torch.distributed.TCPStore("127.0.0.1", port, world_size, rank == 0, timeout=long), long)
    params = list(torch.nn.Linear(4, 1).parameters())
    if rank == 1:
        jobs.store.set(jobs.key("test", "pid"), str(os.getpid()))
        client = ServerClient(jobs, 0, [params], [], link_timeout, long)
        client.join()
        for p in params:
            p.grad = torch.zeros_like(p)
        client.push_pull(0.0, 1)
        client.leave()
        return [str(client.incarnation)]
    lines: list[str] = []
    server = ParameterServer(params, torch.optim.SGD(params, lr=0.1), [], 1, None, torch.device("cpu"),
                             log=lambda worker, what: lines.append(what))
    pid, accepted = int(jobs.store.get(jobs.key("test", "pid"))), server.join

    def join_and_freeze(worker: int, incarnation: int, timeout_s: float):
        member = accepted(worker, incarnation, timeout_s)
        if incarnation == 1:
            os.kill(pid, signal.SIGSTOP)
        return member

    server.join = join_and_freeze
    links = ServerLinks(server, jobs, 0, link_timeout, long)
    links.start()
    server.open(0, None)
    deadline = time.monotonic() + 60
    while not any("stopped responding" in line for line in lines) and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(pid, signal.SIGCONT)
    while not any("left: it finished" in line for line in lines) and time.monotonic() < deadline:
        time.sleep(0.05)
    links.stop()
    return lines


def test_a_worker_frozen_while_its_join_is_answered_joins_again():
    """A worker that froze while the server answered its join (SIGSTOP from the server's side) is dropped as
    frozen; woken, it reads in the store that it was dropped, joins again as a new incarnation, pushes and
    leaves, and the server carries on. It must not take the closed link for a dead server."""
    lines, (incarnation,) = run_workers(frozen_while_joining, 2, find_free_network_port(), 2.0, timeout=120)
    assert incarnation == "2", lines
    assert lines[0].startswith("joined at") and lines[1].startswith("left: it stopped responding"), lines
    assert lines[2].startswith("joined again") and lines[-1] == "left: it finished", lines
