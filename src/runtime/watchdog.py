"""When a rank dies or freezes, every other rank ends soon, and one line says which rank failed.

torch's collectives notice a dead peer (gloo: "Connection closed by peer", within seconds) but not which
one, and a frozen peer (stopped, swapped out, stuck holding the GIL) only after the process-group
timeout (30 min by default), after which the frozen rank is left running. torchelastic's agent
watches its own node's workers only, and Lightning's launcher watches nothing.

:class:`RankWatchdog` adds a heartbeat: each rank publishes its host and PID in the rendezvous store,
then a daemon thread bumps a counter there every ``interval_s`` and reads the others'. A rank whose
counter has not moved for ``timeout_s``, or whose process is gone (same host), has failed: the
watcher prints one line naming it, ends the failed process if it is on this host (a frozen rank
would otherwise outlive the job), ends the ranks this process launched, and exits. A collective that
fails in the main thread first asks the watchdog (:meth:`RankWatchdog.end_if_a_peer_failed`), so a
dead peer is named instead of a gloo traceback. Only the lowest live rank prints.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import signal
import socket
import sys
import threading
import time

import psutil
from torch.distributed import Store, TCPStore

from src.runtime.exit_cleanup import announce_peer_failure
from src.runtime.launch_context import launch_context
from src.utils.pylogger import RankedLogger

log = RankedLogger(__name__)

EXIT_PEER_FAILED = 1
REPORTED = "reported its own error"  # a peer that printed why it stopped: this rank stops quietly
STORE_GRACE_S = 10.0  # the store may vanish while its host exits normally: only a lasting silence is a failure


class RankWatchdog:
    """Heartbeats between the ranks of one process group, through a client of its rendezvous store."""


    def __init__(self, rank: int, world_size: int, timeout_s: float = 120.0, interval_s: float = 1.0,
                 store: Store | None = None) -> None:
        self.rank, self.world_size = rank, world_size
        self.timeout_s, self.interval_s = timeout_s, interval_s
        self.prefix = ""  # set in start(), per session
        self.peers: dict[int, dict] = {}
        self._last_seen: dict[int, tuple[int, float]] = {}
        self._finished: dict[int, str] = {}  # peers that ended on purpose: "done", or "reported" (their own error)
        self._store_silent_since: float | None = None
        self._stop = threading.Event()
        self._store = store  # None: a client of the TCP store at MASTER_ADDR:MASTER_PORT
        self._thread: threading.Thread | None = None

    # -- life cycle ------------------------------------------------------------------------------------
    def start(self) -> None:
        """Publish this rank, read every rank's host and PID, start beating (call after the group exists)."""
        ctx = launch_context()
        if self._store is None:
            self._store = TCPStore(ctx.master_addr, int(ctx.master_port), is_master=False,
                                   timeout=dt.timedelta(seconds=self.timeout_s))
        # A torchrun restart keeps the agent's store, and fit then test start two watchdogs on one store:
        # keys of an earlier attempt or session must not count. Every rank counts its sessions on this store.
        attempt = ctx.restart_count
        session = self._store.add(f"lightning_hydra_template/watchdog/{attempt}/sessions/{self.rank}", 1)
        self.prefix = f"lightning_hydra_template/watchdog/{attempt}/{session}/"
        me = {"host": socket.gethostname(), "pid": os.getpid()}
        self._store.set(self._key("info", self.rank), json.dumps(me))
        self._store.set(self._key("beat", self.rank), "0")
        keys = [self._key("info", r) for r in range(self.world_size)]
        self._store.wait(keys, dt.timedelta(seconds=self.timeout_s))
        self.peers = {r: json.loads(self._store.get(k)) for r, k in enumerate(keys)}
        now = time.monotonic()
        self._last_seen = {r: (-1, now) for r in range(self.world_size) if r != self.rank}
        self._thread = threading.Thread(target=self._run, name="rank-watchdog", daemon=True)
        self._thread.start()

    def finish(self, reported: bool = False) -> None:
        """This rank ends on purpose (teardown, or an error it reports itself): stop beating, tell the peers."""
        self._stop.set()
        with contextlib.suppress(Exception):
            self._store.set(self._key("finished", self.rank), "reported" if reported else "done")

    def _key(self, kind: str, rank: int) -> str:
        return f"{self.prefix}{kind}/{rank}"

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            failed = self.failed_peer()
            if failed is not None and not self._stop.is_set():
                self._end(*failed)

    # -- diagnosis -------------------------------------------------------------------------------------
    def failed_peer(self, stale_after_s: float | None = None) -> tuple[int, str] | None:
        """Beat once and check the others: ``(rank, what happened)`` for the first failed peer, else None.

        A peer fails when its process on this host is gone, or its beat has not moved for ``stale_after_s``
        (default ``timeout_s``).
        """
        stale_after_s = self.timeout_s if stale_after_s is None else stale_after_s
        now = time.monotonic()
        try:
            self._store.add(self._key("beat", self.rank), 1)
            for r in self._last_seen:
                if r not in self._finished and self._store.check([self._key("finished", r)]):
                    self._finished[r] = self._store.get(self._key("finished", r)).decode()
            beats = {r: int(self._store.get(self._key("beat", r))) for r in self._last_seen if r not in self._finished}
            self._store_silent_since = None
        except Exception:  # the TCP store's host (rank 0 under Lightning's launcher, else the agent) is gone
            dead = [r for r in self._last_seen if self._finished.get(r) != "done" and not self._alive_here(r)]
            if dead:
                return (dead[0], REPORTED if self._finished.get(dead[0]) == "reported" else "died")
            self._store_silent_since = self._store_silent_since or now
            if now - self._store_silent_since < STORE_GRACE_S or self._finished.get(0) == "done":
                return None
            if self._finished.get(0) == "reported":
                return (0, REPORTED)
            ctx = launch_context()
            return (0, f"is unreachable: the rendezvous store at {ctx.master_addr}:{ctx.master_port} stopped answering")
        for peer, (count, since) in sorted(self._last_seen.items()):
            if peer in self._finished:
                if self._finished[peer] == "reported" and not self._alive_here(peer):
                    return (peer, REPORTED)  # it said why and is gone: this rank may be stuck waiting for it
                continue
            if not self._alive_here(peer):
                return (peer, "died")
            if beats[peer] != count:
                self._last_seen[peer] = (beats[peer], now)
            elif now - since > stale_after_s:
                return (peer, f"stopped responding {now - since:.0f} s ago")
        return None

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
        self._stop.set()
        if what == REPORTED:  # its one line is the job's message; this rank adds the quiet one
            announce_peer_failure(self.rank)
            for child in psutil.Process().children(recursive=True):
                _kill(child.pid)
            os._exit(EXIT_PEER_FAILED)
        info = self.peers.get(peer, {})
        where = f"rank {peer} (host {info.get('host', '?')}, pid {info.get('pid', '?')})"
        here = info.get("host") == socket.gethostname()
        survivors = [r for r in range(self.world_size) if r != peer and self._alive_here(r)]
        if self.rank == min(survivors, default=self.rank):  # one line per job, from the lowest live rank
            print(f"error: {where} {what}; every rank stops now. fix: see that rank's log; "
                  "re-running the same command resumes from the last checkpoint", file=sys.stderr, flush=True)
        if here and info.get("pid") not in (None, os.getpid()):
            _kill(info["pid"])  # a frozen rank on this host would outlive the job
        for child in psutil.Process().children(recursive=True):  # ranks this process launched
            _kill(child.pid)
        os._exit(EXIT_PEER_FAILED)


def _kill(pid: int) -> None:
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
