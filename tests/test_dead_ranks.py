"""A rank that dies, freezes or gets stuck ends every rank soon, with one line naming it, and leaves no process
behind.

Two DDP (or FSDP) ranks over gloo, started as a user would; the fault is a real signal to one rank: SIGKILL (dead)
or SIGSTOP (frozen: no heartbeat, no progress, no exit), or a rank whose main thread gets stuck in an
all-reduce its peer never joins, or in a blocking call, while its other threads live. The run stays
resumable (last.ckpt).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time

import psutil
import pytest
import yaml

from tests.helpers.training_runs import finish, run_dirs, start, wait_for_checkpoint

# Bounds on seconds with slack for a busy machine, so these run beside another test file like the rest (make test).
pytestmark = [pytest.mark.slow, pytest.mark.faults]

LONG = ["trainer.devices=2", "trainer.max_epochs=50", "trainer.strategy.hang_timeout_s=5"]


def ranks(proc) -> dict[int, psutil.Process]:
    """Rank 0 is the process the user started; rank 1 is its child (Lightning's launcher)."""
    (child,) = psutil.Process(proc.pid).children()
    return {0: psutil.Process(proc.pid), 1: child}


@pytest.mark.parametrize(("victim", "fault", "strategy"),
                         [(1, signal.SIGKILL, "ddp"), (0, signal.SIGKILL, "ddp"), (1, signal.SIGSTOP, "ddp"),
                          (1, signal.SIGKILL, "fsdp"), (1, signal.SIGSTOP, "fsdp")],
                         ids=["rank-1-dies", "rank-0-dies", "rank-1-freezes", "fsdp-rank-1-dies", "fsdp-rank-1-freezes"])
def test_a_failed_rank_ends_the_job_and_is_named(tmp_path, victim, fault, strategy):
    proc = start(tmp_path, f"trainer={strategy}", *LONG)
    procs = {}
    try:
        assert wait_for_checkpoint(proc, tmp_path)
        procs = ranks(proc)
        hit = procs[victim]
        os.kill(hit.pid, fault)
        began = time.monotonic()
        if victim == 0:  # the user's process is the victim; what is left to watch is rank 1
            procs[1].wait(timeout=60)
            code = None
        else:
            code = finish(proc, timeout=60)
        took = time.monotonic() - began
    finally:  # pass or fail, no rank outlives the test (rank 1 is in rank 0's session; a dead rank 0 leaves it)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for p in procs.values():
            with contextlib.suppress(psutil.Error):
                if p.is_running():
                    p.kill()
    bound = 5 + 10 if fault == signal.SIGSTOP else 10  # hang_timeout_s + slack; a death is seen at once
    assert took < bound, f"the job took {took:.1f} s to end"
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in procs.values()), \
        "a rank outlived the job"
    if code is not None:
        assert code != 0
        lines = [line for line in proc.stderr_text.splitlines() if line.startswith("error:")]
        assert len(lines) == 1, proc.stderr_text[-3000:]
        assert re.match(rf"error: rank {victim} \(host \S+, pid {hit.pid}\) (died|stopped responding)", lines[0])
        assert "Traceback" not in proc.stderr_text
    (run_dir,) = run_dirs(tmp_path)
    if code is not None:  # rank 0 lived to record why the run ended
        status = yaml.safe_load((run_dir / "status.yaml").read_text())
        assert status["status"] == "failed" and status["detail"].startswith(f"rank {victim} (host "), status
    assert (run_dir / "checkpoints" / "last.ckpt").exists()  # resumable: re-running the command continues


@pytest.mark.parametrize("how", ["collective", "call"])
def test_a_rank_stuck_while_its_threads_live_is_named_within_hang_timeout(tmp_path, how):
    """Its heartbeat thread beats on; it is named because the others wait for it and nobody makes progress."""
    proc = start(tmp_path, "trainer=ddp", *LONG, "+callbacks.stuck._target_=tests.helpers.stuck_rank.StuckRank",
                 f"+callbacks.stuck.how={how}")
    try:
        deadline = time.monotonic() + 120
        while not (marker := next((d / "stuck" for d in run_dirs(tmp_path) if (d / "stuck").is_file()), None)):
            assert proc.poll() is None and time.monotonic() < deadline, "no rank got stuck"
            time.sleep(0.05)
        began = time.monotonic()
        procs = ranks(proc)
        code = finish(proc, timeout=60)
        took = time.monotonic() - began
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert took < 5 + 15, f"the job took {took:.1f} s to end"  # hang_timeout_s + slack on a loaded machine
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in procs.values()), "a rank outlived the job"
    assert code != 0
    lines = [line for line in proc.stderr_text.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, proc.stderr_text[-3000:]
    stuck_pid = int(marker.read_text())
    assert re.match(rf"error: rank 1 \(host \S+, pid {stuck_pid}\) is stuck: no rank has made progress", lines[0])
    assert "Traceback" not in proc.stderr_text

    records = {p.name: json.loads(p.read_text()) for p in (marker.parent / "flight_recorder").iterdir()}
    assert sorted(records) == ["rank_0.json", "rank_1.json"]  # each rank's collectives, as torch's recorder keeps them
    if how == "collective":  # rank 1's last collective is on the group rank 0 never used; rank 0's, on the default one
        ours, theirs = records["rank_1.json"]["entries"][-1], records["rank_0.json"]["entries"][-1]
        assert ours["profiling_name"].endswith("all_reduce") and theirs["process_group"][1] == "default_pg"
        assert ours["process_group"] != theirs["process_group"]
