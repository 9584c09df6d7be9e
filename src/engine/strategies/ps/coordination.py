"""What the ranks of one ps job tell each other through the rendezvous store, and how the job ends on a failure.

No process group spans the job (a worker may leave at any moment), so the few things every rank must
agree on go through the store the ranks met on: the start-up meeting, join requests, who each rank
is (host, pid), a stop asked by a server, the chief's end of training, and who reports a failure.
Keys live under a prefix of this launch and attempt: a torchrun restart keeps its agent's store, and
must not read the keys of the attempt before it.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import socket
import sys
import threading
import time

import torch.distributed as dist

from src.engine.runtime.exit_cleanup import record_ending
from src.engine.runtime.launch_context import launch_context
from src.engine.utils.errors import print_error

EXIT_FAILED = 1
POLL_S = 0.05


class JobStore:
    """The job's keys in ``store``, under a prefix of this torchrun attempt."""

    def __init__(self, store: dist.Store, timeout: dt.timedelta) -> None:
        self.store = store
        self.timeout = timeout
        self.prefix = f"lightning_hydra_template/ps/{launch_context().restart_count}/"

    def key(self, *parts: object) -> str:
        return self.prefix + "/".join(str(p) for p in parts)

    def get(self, *parts: object) -> str | None:
        """The value of a key, or None while nobody has set it."""
        name = self.key(*parts)
        return self.store.get(name).decode() if self.store.check([name]) else None

    def add(self, *parts: object, amount: int = 1) -> int:
        return int(self.store.add(self.key(*parts), amount))

    # -- start-up: every rank of the launch meets once, before any of them loads data ----------------
    def meet(self, world_size: int) -> None:
        """Wait until all ``world_size`` ranks arrived (Lightning's data barrier needs a process group ps
        has not got): each node's first rank prepares the data before its peers read it."""
        if self.get("started") is not None:  # a restarted worker: the job is running, the data is there
            return
        arrived = self.add("meet")
        deadline = time.monotonic() + self.timeout.total_seconds()
        while arrived < world_size:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {arrived} of {world_size} ranks arrived within {self.timeout}")
            time.sleep(POLL_S)
            arrived = self.add("meet", amount=0)
        self.store.set(self.key("started"), "1")

    def publish_self(self, rank: int) -> None:
        self.store.set(self.key("info", rank), json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))

    def describe(self, rank: int) -> str:
        """``rank 3 (host h, pid 123)`` as published at start-up (``?`` where the store does not say)."""
        try:
            info = json.loads(self.get("info", rank) or "{}")
        except Exception:  # the store's host is gone
            info = {}
        return f"rank {rank} (host {info.get('host', '?')}, pid {info.get('pid', '?')})"

    # -- workers a server dropped -------------------------------------------------------------------
    def mark_dropped(self, server: int, worker: int, incarnation: int) -> None:
        """``server`` closed this incarnation's link (it froze, or its link failed)."""
        self.store.set(self.key("dropped", server, worker, incarnation), "1")

    def was_dropped(self, server: int, worker: int, incarnation: int) -> bool:
        """Whether ``server`` dropped this incarnation: its link failed because of that, not because it died."""
        try:
            return self.get("dropped", server, worker, incarnation) is not None
        except Exception:  # the store's host (the chief) is gone
            return False

    # -- the end of the job ------------------------------------------------------------------------
    def request_stop(self, signum: int) -> None:
        """A server got a stop signal: the chief saves and ends the job at its next step."""
        self.store.set(self.key("stop"), str(signum))

    def stop_requested(self) -> int:
        return int(self.get("stop") or 0)

    def finish(self, how: str) -> None:
        """The chief ended training (``finished``, ``stopped <signum>`` or ``failed``): every rank ends."""
        with contextlib.suppress(Exception):  # on a failed job the store may be gone already
            self.store.set(self.key("done"), how)

    def finished(self) -> str | None:
        return self.get("done")

    def ended(self) -> str | None:
        """How the chief ended the job, or None while it runs or when the store cannot say (its host is gone)."""
        try:
            return self.finished()
        except Exception:
            return None

    def claim_report(self) -> bool:
        """True for the first rank to report a failure: it prints the job's one line, the others stay quiet."""
        return self.add("failed") == 1


def stopped_by(how: str | None) -> int:
    """The signal a job that ended ``how`` (:meth:`JobStore.finish`) was stopped by; 0 if none."""
    return int(how.split()[1]) if how is not None and how.startswith("stopped ") else 0


class EndWatch:
    """A worker's last resort: a thread that ends this process once the job has ended and the worker has not.

    A worker whose main thread is stuck (a deadlocked data loader, a hung C call) is dropped by the servers and
    the job ends without it, but its process would live on and hold its node: an ``srun`` step or a torchrun
    agent waits for every task. Once the store says the job ended (or has been unreachable) for ``grace_s``,
    the thread prints one line and exits with the job's code. A worker that ends normally stops the watch.
    """

    POLL_S = 1.0

    def __init__(self, jobs: JobStore, rank: int, grace_s: float) -> None:
        self.jobs, self.rank, self.grace_s = jobs, rank, grace_s
        self.stopping = threading.Event()
        threading.Thread(target=self._run, name="ps-end-watch", daemon=True).start()

    def stop(self) -> None:
        self.stopping.set()

    def _run(self) -> None:
        ended_at = None
        while not self.stopping.wait(self.POLL_S):
            try:
                how = self.jobs.finished()
            except Exception:  # the store's host (the chief) is gone: the job is over
                how = "its store is gone"
            if how is None:
                ended_at = None  # running (after a passing store error, too)
                continue
            ended_at = ended_at or time.monotonic()
            if time.monotonic() - ended_at >= self.grace_s and not self.stopping.is_set():
                print(f"rank {self.rank}: the job ended ({how}) {self.grace_s:g} s ago and this worker is still in its "
                      "step (stuck); it exits now", file=sys.stderr, flush=True)
                signum = stopped_by(how)
                os._exit(0 if how == "finished" else 128 + signum if signum else EXIT_FAILED)  # the job's own code


def end_job_after_failure(jobs: JobStore | None, rank: int, what: str, fallback_reporter: bool) -> None:
    """A rank the job cannot do without failed: print the job's one line (or the quiet line), then exit.

    The first rank to claim the report in the store prints ``error: ...``; the others print that they stop
    because of it. When the store is gone too (its host was the failed rank), ``fallback_reporter`` decides.
    """
    try:
        reporter = jobs.claim_report() if jobs is not None else fallback_reporter
    except Exception:
        reporter = fallback_reporter
    if reporter:
        print_error(f"{what}; every rank stops now. fix: see that rank's log; re-running the same command "
                    "resumes from the last checkpoint")
    else:
        print(f"rank {rank}: stopping because another rank failed (its error is above)", file=sys.stderr, flush=True)
    record_ending(what or "another rank failed (its error is in the log)")  # e.g. the chief's status.yaml
    sys.stdout.flush()
    os._exit(EXIT_FAILED)  # from any thread, with links blocked in gloo: nothing left to save on this rank
