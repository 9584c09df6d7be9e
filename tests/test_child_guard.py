"""The guard over child ranks: after a child fails it waits its grace (the watchdog's time to name the rank),
then ends the ranks left and its own process. Real processes."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.helpers.config import ROOT

pytestmark = pytest.mark.fast

PARENT = """
import subprocess, sys, time
from src.engine.runtime.child_guard import guard_child_ranks
children = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]),
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5); raise SystemExit(CODE)"])]
print(children[0].pid, flush=True)
guard_child_ranks(children, grace_s=GRACE, poll_s=0.1)
time.sleep(LIFE)
"""


def run_parent(grace_s: float, child_code: int = 3, life_s: float = 60) -> tuple[int, float, int]:
    """(the parent's exit code, its life in seconds, the pid of its child that would have slept on)."""
    started = time.monotonic()
    parent = PARENT.replace("GRACE", str(grace_s)).replace("CODE", str(child_code)).replace("LIFE", str(life_s))
    proc = subprocess.Popen([sys.executable, "-c", parent], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    sleeper = int(proc.stdout.readline())
    code = proc.wait(timeout=60)
    return code, time.monotonic() - started, sleeper


def test_a_failed_child_ends_the_others_and_the_parent_after_the_grace():
    code, took, sleeper = run_parent(grace_s=2.0)
    assert code == -signal.SIGKILL
    assert 2.5 <= took < 30, took  # not before the child failed (0.5 s) plus the grace
    deadline = time.monotonic() + 5
    while psutil.pid_exists(sleeper) and psutil.Process(sleeper).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the sleeping child outlived the guard"
        time.sleep(0.05)


def test_a_child_that_stopped_on_a_signal_is_not_a_failure():
    """A rank exits 143 after the agreed checkpoint of a SIGTERM: rank 0 may take longer than the grace to
    requeue the job, and the guard lets it (it lives its 3 s and exits 0)."""
    code, took, sleeper = run_parent(grace_s=0.5, child_code=128 + signal.SIGTERM, life_s=3)
    psutil.Process(sleeper).kill()
    assert code == 0 and took >= 3, (code, took)
