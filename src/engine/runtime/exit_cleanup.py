"""Destroy the default process group before the interpreter shuts down, for every backend.

Why: a gloo collective's work object is released by the process group's worker thread
(``pt_gloo_runloop``) *after* ``wait()`` has returned to Python. Releasing it drops its tensors,
which needs the GIL. If the main thread has meanwhile begun interpreter shutdown (a spawned
rank returning right after the last metric sync), that thread is killed while taking the GIL
and the process dies with SIGABRT ("terminate called without an active exception"), for example
a ``ddp_spawn`` rank right after the last metric sync of ``trainer.test()`` (docs/faults.md).

Destroying the group from an ``atexit`` handler joins those threads while Python is still
whole. A sub-group's threads are joined only when its last Python reference goes, so objects
that hold sub-groups (the pipeline's mesh, metrics synced over a sub-group) register a
*release* that drops those references first (:func:`release_before_destroy`). Lightning registers
the same handler, but only for nccl.

The price: destroying waits for collectives still in flight. A rank that fails with an async
collective outstanding exits only once its peers join it (or the group's timeout passes). Peers that
run the same code join promptly, so only a job that was already deadlocked waits for the timeout.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator

import torch.distributed as dist

from src.engine.runtime.launch_context import CHILD, launch_context

_releases: list[weakref.WeakMethod] = []


def release_before_destroy(release: Callable[[], None]) -> None:
    """Call the bound method ``release`` before the group is destroyed, if its object still lives.

    Held weakly, so registering does not keep a strategy (or anything else) alive.
    """
    _releases.append(weakref.WeakMethod(release))


def destroy_default_group() -> None:
    """Run the registered releases, then destroy the default group and its sub-groups (idempotent)."""
    while _releases:
        release = _releases.pop()()
        if release is not None:
            release()
    if dist.is_available() and dist.is_initialized():
        with _sigint_ignored():  # as Lightning's handler: a Ctrl+C must not cut the teardown short
            dist.destroy_process_group()


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def destroy_default_group_at_exit() -> None:
    """Register :func:`destroy_default_group` to run at interpreter exit, once per process."""
    atexit.unregister(destroy_default_group)  # a sweep sets up a group per job: keep one handler
    atexit.register(destroy_default_group)


# -- a rank whose peer is gone ------------------------------------------------------------------------------
_before_ending: list[Callable[[str], None]] = []


@contextlib.contextmanager
def before_a_failure_ends_this_rank(record: Callable[[str], None]) -> Iterator[None]:
    """While inside, ``record(why)`` runs before this process ends at once for another rank's failure (the
    watchdog, or a parameter-server job that lost a server: they ``os._exit``, so no ``finally`` or ``except`` of
    the task runs): e.g. to write the run's status."""
    _before_ending.append(record)
    try:
        yield
    finally:
        _before_ending.remove(record)


def record_ending(why: str) -> None:
    """Run the records of :func:`before_a_failure_ends_this_rank`, just before this process ``os._exit``s."""
    for record in list(_before_ending):
        with contextlib.suppress(Exception):  # the process ends next whatever happens here
            record(why)


# What gloo/torch say when the other end of a collective went away (the peer exited or crashed).
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
PEER_FAILURE_EXIT_CODE = 1  # not 2: the bad input, if any, is the failed peer's to report
_LAUNCHER_EXIT_WAIT_S = 10.0
# The process that started this one, read at import (at start-up): a child rank's launcher may exit, and the
# rank be re-parented, before the rank reports, and waiting for the new parent to exit would wait in vain.
_STARTED_BY = os.getppid()


def peer_failed(err: BaseException) -> bool:
    """True when ``err`` (or its cause) says a collective lost its peer: another rank failed or exited.

    That rank prints its own error (one line for bad input, a traceback for a bug); this one has nothing
    to add.
    """
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, RuntimeError | ConnectionError) and any(text in str(seen) for text in _PEER_GONE):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def exit_after_peer_failure(rank: int) -> None:
    """Stop this rank quietly (one line, no traceback, exit 1) because another rank failed.

    A rank started by Lightning's launcher waits (a few seconds at most) for the launcher, global rank 0,
    to exit first: the launcher watches its children and SIGKILLs itself when one exits non-zero, which
    would replace its own exit code (2 for bad input) by -9.
    """
    announce_peer_failure(rank)
    raise SystemExit(PEER_FAILURE_EXIT_CODE)


def announce_peer_failure(rank: int) -> None:
    """Print this rank's one quiet line, then let the failed rank be the one its launcher reports.

    A child of Lightning's launcher waits for the launcher to exit first. A ``ddp_spawn`` rank waits for its
    parent to end it: torch's spawn reports the first rank to exit non-zero and SIGTERMs the others, so a
    healthy rank that exited first would be named in place of the failed one, whose teardown (a logger's
    finish, say) can outlast its closed connections.
    """
    print(
        f"rank {rank}: stopping because another rank failed (its error is above)", file=sys.stderr, flush=True
    )
    spawned = multiprocessing.parent_process() is not None
    if launch_context().launcher == CHILD or spawned:
        if spawned and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the parent's SIGTERM ends this wait at once
        deadline = time.monotonic() + _LAUNCHER_EXIT_WAIT_S
        while os.getppid() == _STARTED_BY and time.monotonic() < deadline:
            time.sleep(0.05)

