"""A server's threads: one takes join requests from the store and watches the job's keys, one per link serves it.

A thread per link because each link blocks in gloo receives of its own; the work they share (applying a
push, waiting for the others) is :class:`~src.engine.strategies.ps.server.ParameterServer`'s, behind its lock.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import signal
import threading
import time

import torch

from src.engine.strategies.ps.coordination import POLL_S, JobStore
from src.engine.strategies.ps.link import (
    EVICTED,
    HEADER,
    JOIN,
    LEAVE,
    OK,
    PUSH,
    READ,
    READ_STATE,
    Link,
    header,
)
from src.engine.strategies.ps.server import ParameterServer

FLAG_POLL_S = 0.25
STORE_GRACE_S = 10.0  # the store may be briefly busy; only a lasting silence means its host is gone


def why_it_left(err: BaseException, timeout: dt.timedelta) -> str:
    """A worker's link failed: what that says about the worker, in a few words."""
    text = str(err)
    if any(s in text for s in ("Timed out", "timed out", "Wait timeout")):
        return f"left: it stopped responding for {timeout.total_seconds():g} s"
    if any(s in text for s in ("Connection closed", "Connection reset", "Broken pipe")):
        return "left: its process is gone"
    return f"left: {text.splitlines()[0][:200] if text else type(err).__name__}"


class ServerLinks:
    """The threads of server ``index``: the join listener (which also reads the job's keys) and the links."""

    def __init__(self, server: ParameterServer, jobs: JobStore, index: int, timeout: dt.timedelta,
                 start_timeout: dt.timedelta) -> None:
        self.server, self.jobs, self.index, self.timeout = server, jobs, index, timeout
        self.start_timeout = start_timeout  # how long the first workers wait for the others to join
        self.stopping = threading.Event()
        self.done: str | None = None  # the chief's end of training (JobStore.finish)
        self.stop_signal = 0  # a server asked the job to stop (JobStore.request_stop)
        self.failed = False  # a rank reported a failure: this one ends quietly
        self.store_lost = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._listen, name=f"ps-server-{self.index}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.stopping.set()

    # -- the listener ------------------------------------------------------------------------------
    def _listen(self) -> None:
        n, next_flags, silent_since = 1, 0.0, None
        while not self.stopping.is_set():
            try:
                request = self.jobs.get("join", self.index, n)
                if time.monotonic() >= next_flags:
                    self._read_flags()
                    next_flags = time.monotonic() + FLAG_POLL_S
                silent_since = None
            except Exception:  # the store's host is gone (the chief, under torchrun's agent: never)
                silent_since = silent_since or time.monotonic()
                self.store_lost = time.monotonic() - silent_since > STORE_GRACE_S
                time.sleep(POLL_S)
                continue
            if request is None:
                time.sleep(POLL_S)
                continue
            n += 1
            kind, client, incarnation = request.split()
            target = self._serve_worker if kind == "worker" else self._serve_reader
            threading.Thread(target=target, args=(int(client), int(incarnation)), daemon=True,
                             name=f"ps-link-{self.index}-{client}").start()

    def _read_flags(self) -> None:
        self.done = self.jobs.finished()
        self.stop_signal = self.jobs.stop_requested()
        self.failed = self.jobs.add("failed", amount=0) > 0

    # -- a worker's link -----------------------------------------------------------------------------
    def _serve_worker(self, worker: int, incarnation: int) -> None:
        server, reason, link = self.server, "left: it finished", None
        hdr = torch.zeros(HEADER, dtype=torch.float64)
        grad, params_out = torch.empty_like(server.flat, device="cpu"), torch.empty_like(server.flat, device="cpu")
        buffers_in, buffers_out = torch.empty_like(server.buffer_flat), torch.empty_like(server.buffer_flat)
        with_buffers = server.buffer_flat.numel() > 0
        try:
            link = Link(self.jobs.store, self.jobs.key("link", self.index, worker, incarnation), 0, self.timeout)
            while True:
                link.recv(hdr)
                kind = int(hdr[0])
                if kind == LEAVE:
                    if int(hdr[3]):
                        reason = f"left: it stopped on {signal.Signals(int(hdr[3])).name}"
                    break
                if kind == JOIN:
                    status, clock = OK, server.join(worker, incarnation, self.start_timeout.total_seconds()).clock
                elif kind == PUSH:
                    link.recv(grad, *([buffers_in] if with_buffers else []))
                    status = server.push(worker, incarnation, grad, buffers_in if with_buffers else None,
                                         float(hdr[3]), float(hdr[4]), int(hdr[5]))
                    clock = 0
                else:
                    raise RuntimeError(f"unexpected message kind {kind}")
                version = server.read(params_out, buffers_out if with_buffers else None)
                for work in link.send(header(status, version, clock), params_out,
                                      *([buffers_out] if with_buffers else [])):
                    work.wait()
                if status == EVICTED:  # the worker joins again on a new link
                    reason = ""
                    break
        except Exception as err:
            reason = why_it_left(err, self.timeout)
            with contextlib.suppress(Exception):  # a frozen worker that wakes reads this and joins again
                self.jobs.mark_dropped(self.index, worker, incarnation)
        finally:
            if reason:
                server.leave(worker, incarnation, reason)
            if link is not None:
                link.close()

    # -- the chief reading this server's share (evaluation, checkpoints) -----------------------------
    def _serve_reader(self, reader: int, incarnation: int) -> None:
        server = self.server
        with contextlib.suppress(Exception):  # the chief failed mid-read: its own failure ends the job
            link = Link(self.jobs.store, self.jobs.key("read", self.index, reader, incarnation), 0, self.timeout)
            hdr = torch.zeros(HEADER, dtype=torch.float64)
            link.recv(hdr)
            params = torch.empty_like(server.flat, device="cpu")
            with server.cond:  # the parameters and the optimizer state of one moment
                state = server.optimizer_state() if int(hdr[0]) == READ_STATE else None
                version = server.read(params)
            for work in link.send(header(OK, version), params):
                work.wait()
            if int(hdr[0]) == READ_STATE:
                link.send_object(state)
            elif int(hdr[0]) != READ:
                raise RuntimeError(f"unexpected message kind {int(hdr[0])}")
            link.close()
