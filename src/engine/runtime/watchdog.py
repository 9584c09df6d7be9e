"""When a rank dies, freezes or gets stuck, every rank ends soon, and one line names the rank that failed.

torch's collectives notice a dead peer (gloo: "Connection closed by peer", within seconds) but not which
one; a frozen peer (stopped, swapped out, stuck holding the GIL), or one whose main thread is stuck in a
collective its peers never join or in a blocking call, only after the process-group timeout (10 min
here), after which the stuck rank is left running. torchelastic's agent watches its own node's workers
only, and Lightning's launcher SIGKILLs every rank when a child fails, naming none
(:mod:`src.engine.runtime.child_guard` replaces it, and leaves this watchdog time to speak first).

:class:`RankWatchdog` adds a heartbeat through the rendezvous store. Every ``interval_s`` a daemon thread
in each rank writes one key: a counter, and the rank's progress (training, validation and test batches
done, and the default group's collective sequence number, both counted by the main thread). Global rank
0 reads every rank's key in one request; every other rank reads rank 0's key and the verdict key. So the
store serves about two requests per rank per interval, O(N) in all (each rank reading every other rank's
key, N**2, stopped scaling at a few hundred ranks). A failure:

* a dead rank: its process is gone; every rank checks the processes of the ranks on its own host
  (no store traffic), so it is seen within ``interval_s`` on its host;
* a frozen rank: its counter stands still for ``timeout_s`` (rank 0 watches everyone, the others
  watch rank 0);
* a stuck rank: nobody's progress has moved for ``timeout_s`` (after every rank's first batch) and
  this rank is behind the others: it is the one they wait for (rank 0 compares).

The rank that finds it writes the verdict (``compare_set``: the first one wins) and prints one line
naming the rank, its host and PID; every rank reads the verdict within ``interval_s``, writes its
collectives' flight-recorder record (:func:`src.engine.runtime.flight_recorder.write`) when the
rank was stuck, ends the failed process if it is on its host (it would outlive the job), ends the ranks
it launched, and exits. A collective that fails in the main thread first asks the watchdog
(:meth:`RankWatchdog.end_if_a_peer_failed`), so a dead peer is named instead of a gloo traceback.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable

import psutil
import torch.distributed as dist
from torch.distributed import Store, TCPStore

from src.engine.runtime import flight_recorder
from src.engine.runtime.exit_cleanup import announce_peer_failure, record_ending
from src.engine.runtime.launch_context import LaunchContext, launch_context
from src.engine.utils.errors import print_error
from src.engine.utils.pylogger import RankedLogger

log = RankedLogger(__name__)

EXIT_PEER_FAILED = 1
REPORTED = "reported its own error"  # a peer that printed why it stopped: this rank stops quietly
STORE_GRACE_S = 10.0  # the store may vanish while its host exits normally: only a lasting silence is a failure
DONE, REPORTED_KEY = "done", "reported"  # what a rank that ends on purpose leaves in its heartbeat key

Progress = Callable[[], tuple[int, int, int]]  # (batches done, collectives entered, global step)


def _no_progress() -> tuple[int, int, int]:
    return (0, 0, 0)


class RankWatchdog:
    """Heartbeats between the ranks of one process group, through a client of its rendezvous store.

    ``progress``: read by the heartbeat thread every ``interval_s``; ``flight_recorder_dir``: where each
    rank writes its collectives' record when a rank is found stuck (None: not written).
    """

    def __init__(self, rank: int, world_size: int, timeout_s: float = 120.0, interval_s: float = 1.0,
                 store: Store | None = None, progress: Progress = _no_progress,
                 flight_recorder_dir: str | os.PathLike | None = None) -> None:
        self.rank, self.world_size = rank, world_size
        self.timeout_s, self.interval_s = timeout_s, interval_s
        self.progress, self.flight_recorder_dir = progress, flight_recorder_dir
        self.prefix = ""  # set in start(), per session
        self.peers: dict[int, dict] = {}
        self.local: list[int] = []  # the other ranks on this host: their processes are checked here
        self.watched: list[int] = []  # the ranks whose heartbeat this rank reads: all (rank 0) or rank 0
        self._beat = 0
        self._last_seen: dict[int, tuple[str, float]] = {}  # rank -> (its counter, when it last moved)
        self._progress: dict[int, tuple[int, int]] = {}  # rank 0: everyone's last progress ...
        self._progress_since = 0.0  # ... and when any of it last moved
        self._seen_progress: dict[int, tuple[int, int]] = {}
        self._steps: dict[int, int] = {}
        self._finished: dict[int, str] = {}  # peers that ended on purpose: "done", or "reported" (their own error)
        self._store_silent_since: float | None = None
        self._stop = threading.Event()
        self._ending = threading.Lock()  # the heartbeat thread and a failed collective may both find the failure
        self._store = store  # None: a client of the TCP store at MASTER_ADDR:MASTER_PORT
        self._thread: threading.Thread | None = None

    # -- life cycle ------------------------------------------------------------------------------------
    def start(self) -> None:
        """Publish this rank, read every rank's host and PID once, start beating (call after the group exists)."""
        ctx = launch_context()
        if self._store is None:
            self._store = TCPStore(ctx.master_addr, int(ctx.master_port), is_master=False,
                                   timeout=dt.timedelta(seconds=self.timeout_s))
        self.prefix = f"lightning_hydra_template/watchdog/{self._session(ctx)}/"
        if self.rank == 0:
            self._store.set(self._key("verdict"), "")  # exists before any rank reads it (one request, no wait)
        self._store.set(self._key("info", self.rank), json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
        self._publish()
        keys = [self._key("info", r) for r in range(self.world_size)]
        self._store.wait([*keys, self._key("verdict")], dt.timedelta(seconds=self.timeout_s))
        self.peers = {r: json.loads(v) for r, v in enumerate(self._store.multi_get(keys))}
        host = socket.gethostname()
        self.local = [r for r, info in self.peers.items() if info["host"] == host and r != self.rank]
        self.watched = [r for r in range(self.world_size) if r != self.rank] if self.rank == 0 else [0]
        now = time.monotonic()
        self._last_seen = {r: ("", now) for r in self.watched}
        self._progress_since = now
        self._thread = threading.Thread(target=self._run, name="rank-watchdog", daemon=True)
        self._thread.start()

    def _session(self, ctx: LaunchContext) -> str:
        """A name for this watchdog's keys that every rank shares and no earlier one used: a torchrun restart keeps
        the agent's store, and fit then test start two watchdogs on one store.

        With a process group, rank 0 draws a number from a counter on the store and gives it to every rank: after
        an elastic change of nodes, the agents' restart counts differ. Without one (many ranks simulated on one
        store), each rank counts its own sessions within its restart attempt.
        """
        if dist.is_available() and dist.is_initialized():
            number = [self._store.add("lightning_hydra_template/watchdog/sessions", 1) if self.rank == 0 else None]
            dist.broadcast_object_list(number, src=0)
            return f"s{number[0]}"
        attempt = ctx.restart_count
        return f"{attempt}/{self._store.add(f'lightning_hydra_template/watchdog/{attempt}/sessions/{self.rank}', 1)}"

    def finish(self, reported: bool = False) -> None:
        """This rank ends on purpose (teardown, or an error it reports itself): stop beating, tell the peers."""
        self._stop.set()
        with contextlib.suppress(Exception):
            self._store.set(self._key("beat", self.rank), REPORTED_KEY if reported else DONE)

    def _key(self, kind: str, rank: int | None = None) -> str:
        return f"{self.prefix}{kind}" + ("" if rank is None else f"/{rank}")

    def _publish(self) -> None:
        self._beat += 1
        batches, collectives, step = self.progress()
        self._store.set(self._key("beat", self.rank), f"{self._beat} {batches} {collectives} {step}")

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            failed = self.failed_peer()
            if failed is not None and not self._stop.is_set():
                self._end(*failed)

    # -- diagnosis -------------------------------------------------------------------------------------
    def failed_peer(self, stale_after_s: float | None = None) -> tuple[int, str] | None:
        """Beat once and check what this rank watches: ``(rank, what happened)`` of a failure, else None.

        A verdict another rank wrote comes first; then a peer on this host whose process is gone; then a
        watched peer whose beat has not moved for ``stale_after_s`` (default ``timeout_s``); on rank 0, a
        rank the others wait for.
        """
        stale_after_s = self.timeout_s if stale_after_s is None else stale_after_s
        now = time.monotonic()
        try:
            self._publish()
            *beats, verdict = self._store.multi_get([*(self._key("beat", r) for r in self.watched),
                                                     self._key("verdict")])
            self._store_silent_since = None
        except Exception:  # the TCP store's host (rank 0 under Lightning's launcher, else the agent) is gone
            return self._store_gone(now)
        if verdict:
            found = json.loads(verdict)
            return found["rank"], found["what"]
        for peer, value in zip(self.watched, (b.decode() for b in beats), strict=True):
            if value in (DONE, REPORTED_KEY):
                self._finished[peer] = value
            else:
                self._note(peer, value, now)
        for peer in self.local:  # processes on this host, without asking the store
            if self._finished.get(peer) != DONE and not self._alive_here(peer):
                return (peer, REPORTED if self._finished.get(peer) == REPORTED_KEY else "died")
        for peer in self.watched:
            if peer in self._finished:
                continue
            since = self._last_seen[peer][1]
            if now - since > stale_after_s:
                return (peer, f"stopped responding {now - since:.0f} s ago")
        return self._stuck(now, stale_after_s) if self.rank == 0 else None

    def _note(self, peer: int, value: str, now: float) -> None:
        beat, batches, collectives, step = value.split()
        if beat != self._last_seen[peer][0]:
            self._last_seen[peer] = (beat, now)
        self._progress[peer], self._steps[peer] = (int(batches), int(collectives)), int(step)

    def _stuck(self, now: float, stale_after_s: float) -> tuple[int, str] | None:
        """Rank 0: the rank the others wait for, once nobody's progress has moved for ``stale_after_s``."""
        batches, collectives, step = self.progress()
        self._progress[0], self._steps[0] = (batches, collectives), step
        live = {r: p for r, p in self._progress.items() if r not in self._finished}
        if self._seen_progress != live:
            self._seen_progress, self._progress_since = live, now
            return None
        if len(live) < 2 or min(b for b, _ in live.values()) == 0:  # before every rank's first batch
            return None
        idle = now - self._progress_since
        behind = min(live.values())
        if idle <= stale_after_s or behind == max(live.values()):
            return None
        rank = min(r for r, p in live.items() if p == behind)
        ahead = sorted(r for r, p in live.items() if p != behind)
        waiting = (f"rank {ahead[0]} waits" if len(ahead) == 1 else f"ranks {', '.join(map(str, ahead))} wait"
                   if len(ahead) <= 4 else f"{len(ahead)} ranks wait")
        return (rank, f"is stuck: no rank has made progress for {idle:.0f} s and {waiting} for it in a collective "
                      f"(it is at global step {self._steps[rank]}: in a collective the others never joined, or in "
                      "a blocking call)")

    def _store_gone(self, now: float) -> tuple[int, str] | None:
        dead = [r for r in self.local if self._finished.get(r) != DONE and not self._alive_here(r)]
        if dead:
            return (dead[0], REPORTED if self._finished.get(dead[0]) == REPORTED_KEY else "died")
        self._store_silent_since = self._store_silent_since or now
        if now - self._store_silent_since < STORE_GRACE_S or self._finished.get(0) == DONE:
            return None
        if self._finished.get(0) == REPORTED_KEY:
            return (0, REPORTED)
        ctx = launch_context()
        return (0, f"is unreachable: the rendezvous store at {ctx.master_addr}:{ctx.master_port} stopped answering")

    def _alive_here(self, peer: int) -> bool:
        """False only when the peer runs on this host and its process is gone."""
        info = self.peers.get(peer, {})
        if info.get("host") != socket.gethostname():
            return True
        try:
            return psutil.Process(info["pid"]).status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def end_if_a_peer_failed(self, wait_s: float | None = None) -> None:
        """After a failed collective: if a peer died or froze, end this rank as :meth:`_end` does; else return.

        A peer that reported its own error is left to the caller (the exception path stops quietly).
        """
        wait_s = 3 * self.interval_s if wait_s is None else wait_s
        deadline = time.monotonic() + wait_s
        while True:  # a collective already failed: a peer whose beat stands still during the wait is gone
            failed = self.failed_peer(stale_after_s=wait_s)
            if failed is not None and failed[1] == REPORTED:
                return
            if failed is not None:
                self._end(*failed)
            if time.monotonic() >= deadline:
                return
            time.sleep(self.interval_s)

    # -- ending ----------------------------------------------------------------------------------------
    def _end(self, peer: int, what: str) -> None:
        self._ending.acquire()  # a second caller in this process waits here until the first ends the process
        self._stop.set()
        if what == REPORTED:  # its one line is the job's message; this rank adds the quiet one
            self._tell(peer, what)
            record_ending(f"rank {peer} {what}")
            announce_peer_failure(self.rank)
            for child in psutil.Process().children(recursive=True):
                _kill(child.pid)
            os._exit(EXIT_PEER_FAILED)
        info = self.peers.get(peer, {})
        where = f"rank {peer} (host {info.get('host', '?')}, pid {info.get('pid', '?')})"
        if self._tell(peer, what):  # the first rank to find it says it, once per job
            print_error(f"{where} {what}; every rank stops now. fix: see that rank's log; "
                        "re-running the same command resumes from the last checkpoint")
        record_ending(f"{where} {what}")
        if what.startswith("is stuck"):
            self._dump_flight_recorder()
        here = info.get("host") == socket.gethostname() and info.get("pid") not in (None, os.getpid())
        if here and what.startswith("is stuck"):  # give it an interval or two to write its record and exit
            with contextlib.suppress(psutil.Error):
                psutil.Process(info["pid"]).wait(timeout=2 * self.interval_s)
        if here:
            _kill(info["pid"])  # a frozen or stuck rank on this host would outlive the job
        for child in psutil.Process().children(recursive=True):  # ranks this process launched
            _kill(child.pid)
        if self.rank == 0:  # under Lightning's launcher rank 0 hosts the TCP store: let the others read the verdict
            time.sleep(min(2 * self.interval_s, 2.0))
        os._exit(EXIT_PEER_FAILED)

    def _tell(self, peer: int, what: str) -> bool:
        """Write the verdict for every rank to read; True when this rank's is the one (nobody wrote one before)."""
        verdict = json.dumps({"rank": peer, "what": what, "by": self.rank, "pid": os.getpid()})
        try:
            return self._store.compare_set(self._key("verdict"), "", verdict).decode() == verdict
        except Exception:  # no store: the lowest rank still standing says it (the others may not see the store)
            return self.rank == min((r for r in range(self.world_size) if r != peer and self._alive_here(r)),
                                    default=self.rank)

    def _dump_flight_recorder(self) -> None:
        """This rank's record of its collectives (torch's flight recorder), in ``flight_recorder_dir``."""
        if self.flight_recorder_dir is None:
            return
        with contextlib.suppress(Exception):  # a record is a bonus: never let it keep a stuck job alive
            flight_recorder.write(self.flight_recorder_dir, self.rank)


def _kill(pid: int) -> None:
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
