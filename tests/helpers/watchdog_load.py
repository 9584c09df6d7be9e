"""Load test harness of the rank watchdog: N heartbeat-only ranks on loopback, one TCP store, no training.

``tests/test_watchdog_load.py`` runs it with 24 ranks; ``python -m scripts.studies.watchdog_load`` with 64,
128 and 256 for the figures in docs/faults.md.

Each rank is a process forked from this one (torch and the watchdog are imported once, so 256 ranks
start in seconds), running :class:`src.engine.runtime.watchdog.RankWatchdog` on a client of a TCPStore that
this process serves on 127.0.0.1, as torchrun's agent serves one. Ranks are grouped into pretend hosts
(``--ranks-per-host``, 8 as on a GPU node): each rank's host name is patched, so it checks the
processes of its own 7 neighbours, as on a real node. Measured, per N:

* the store's load: requests per second (every call a rank makes on its store client is counted in
  shared memory) and the CPU time of this process, which only serves the store during the window;
* the time from SIGKILL (a dead rank) or SIGSTOP (a frozen one) of the last rank, on another host
  than rank 0, to the verdict in the store, and to the moment every rank has exited.
"""

from __future__ import annotations

import ctypes
import datetime as dt
import importlib
import inspect
import json
import multiprocessing
import os
import signal
import socket
import time
from typing import Any

import psutil
from torch.distributed import TCPStore

VERDICT = "lightning_hydra_template/watchdog/0/1/verdict"  # attempt 0, each rank's first session


class CountingStore:
    """A store client that counts every request it sends (in a slot of shared memory)."""

    def __init__(self, store: TCPStore, counts: Any, rank: int) -> None:
        self._store, self._counts, self._rank = store, counts, rank

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._store, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self._counts[self._rank] += 1
            return method(*args, **kwargs)

        return counted


def _rank(module: Any, rank: int, n: int, port: int, counts: Any, per_host: int, timeout_s: float,
          interval_s: float) -> None:
    """One heartbeat-only rank (in a forked child): start the watchdog, then idle as a training loop would."""
    host = f"node{rank // per_host}"
    socket.gethostname = lambda: host  # the watchdog tells hosts apart by name
    client = TCPStore("127.0.0.1", port, is_master=False, timeout=dt.timedelta(seconds=300))
    client.add("ready", 1)  # a rendezvous first, as init_process_group makes before the watchdog starts
    client.wait(["go"])
    kwargs: dict[str, Any] = dict(timeout_s=timeout_s, interval_s=interval_s, store=CountingStore(client, counts, rank))
    if "progress" in inspect.signature(module.RankWatchdog).parameters:
        kwargs["progress"] = lambda: (0, 0, 0)  # no training: only deaths and freezes are in play
    module.RankWatchdog(rank, n, **kwargs).start()
    while True:
        time.sleep(3600)


def measure(n: int, fault: str, per_host: int = 8, timeout_s: float = 10.0, interval_s: float = 1.0,
            window_s: float = 10.0, module_name: str = "src.engine.runtime.watchdog") -> dict[str, Any]:
    """Start ``n`` ranks, measure the store's load over ``window_s``, then ``fault`` ("kill"/"stop"/"none") the
    last one."""
    module = importlib.import_module(module_name)
    counts = multiprocessing.RawArray(ctypes.c_longlong, n)
    with socket.socket() as probe:  # a free port, taken by the store once the ranks are forked
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    began = time.monotonic()
    pids = []
    for rank in range(n):  # forked before this process starts any thread (the store's)
        pid = os.fork()
        if pid == 0:
            try:
                _rank(module, rank, n, port, counts, per_host, timeout_s, interval_s)
            finally:
                os._exit(0)
        pids.append(pid)
    store = TCPStore("127.0.0.1", port, is_master=True, timeout=dt.timedelta(seconds=300), wait_for_workers=False)
    try:
        return _measure(store, pids, counts, n, fault, began, timeout_s, window_s)
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass


def _measure(store: TCPStore, pids: list[int], counts: Any, n: int, fault: str, began: float, timeout_s: float,
             window_s: float) -> dict[str, Any]:
    while store.add("ready", 0) < n:
        time.sleep(0.05)
    started_s = time.monotonic() - began
    store.set("go", "1")
    store.wait([f"lightning_hydra_template/watchdog/0/1/info/{r}" for r in range(n)], dt.timedelta(seconds=300))
    time.sleep(3.0)  # every rank past its start-up reads
    me, workers = psutil.Process(), [psutil.Process(p) for p in pids]
    cpu0, requests0, ranks_cpu0, t0 = _cpu(me), sum(counts), sum(_cpu(w) for w in workers), time.monotonic()
    time.sleep(window_s)
    elapsed = time.monotonic() - t0
    result: dict[str, Any] = {
        "ranks": n, "fault": fault, "start_s": round(started_s, 2),
        "store_requests_per_s": round((sum(counts) - requests0) / elapsed, 1),
        "store_cpu_percent": round(100 * (_cpu(me) - cpu0) / elapsed, 2),
        "ranks_cpu_percent_total": round(100 * (sum(_cpu(w) for w in workers) - ranks_cpu0) / elapsed, 1),
    }
    if fault == "none":
        return result
    victim = pids[-1]
    os.kill(victim, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
    hit = time.monotonic()
    deadline = hit + timeout_s + 60
    def verdict_now() -> str:  # "" until a rank writes it (a watchdog without a verdict key: never)
        return store.get(VERDICT).decode() if store.check([VERDICT]) else ""

    while not verdict_now() and time.monotonic() < deadline:
        time.sleep(0.02)
    verdict = verdict_now()
    result["detect_s"] = round(time.monotonic() - hit, 2) if verdict else None
    result["verdict"] = json.loads(verdict) if verdict else None
    left = set(pids)
    while left and time.monotonic() < deadline:
        for pid in list(left):
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                left.discard(pid)
        time.sleep(0.02)
    result["all_exited_s"] = None if left else round(time.monotonic() - hit, 2)
    return result


def _cpu(proc: psutil.Process) -> float:
    try:
        times = proc.cpu_times()
    except psutil.Error:
        return 0.0
    return times.user + times.system
