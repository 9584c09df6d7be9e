"""End a script's process as soon as its work is written, without the interpreter's teardown.

When ``main()`` returns, CPython joins non-daemon threads, runs the ``atexit`` handlers, and then
tears down every module and frees every object. With torch, Lightning and torchmetrics loaded
(torchmetrics imports torchvision, torch._dynamo and scipy.signal), that last part takes seconds
(docs/benchmarks.md), and nothing in it writes anything. The atexit handlers do
matter: loggers, the process group, temp dirs, multiprocessing's worker clean-up. So they all
still run. Only the teardown after them is skipped.

Use it in a script, never in a library import (pytest's own exit status would be lost):

    if __name__ == "__main__":
        install()        # first, before other imports register their atexit handlers
    ...
    if __name__ == "__main__":
        with exit_code_recorded():
            main()

``install`` registers the handler that ends the process. atexit runs handlers last-registered
first, so a handler registered before every import runs after all of them.

A worker process whose parent owns the exit status (a spawned rank) calls :func:`exit_now` when its work
is done, or :func:`end_spawned_process_promptly` at its start where work follows that it does not own (the
spawn launcher's results queue). Skipping the teardown there also avoids a gloo abort at exit: a gloo worker
thread that still releases a finished collective's tensors needs the GIL, and taking it while the interpreter
is being torn down kills the process with SIGABRT ("terminate called without an active exception").
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import sys
from collections.abc import Iterator
from typing import NoReturn

_exit_code: int | None = None  # set when main() ended; None: leave the exit to the interpreter
_noting_sys_exit = False  # whether end_spawned_process_promptly wrapped sys.exit in this process


def _end_now() -> None:
    if _exit_code is not None:
        exit_now(_exit_code)


def exit_now(code: int) -> NoReturn:
    """Flush logging and the standard streams, then end the process with ``code``, skipping the teardown.

    atexit handlers do not run: call it after they have (as ``install`` does), or where none matter.
    """
    if "logging" in sys.modules:  # its own atexit flush may have been registered before ours
        sys.modules["logging"].shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def install() -> None:
    """Register the prompt exit; call it before the script imports anything that registers atexit handlers."""
    atexit.unregister(_end_now)
    atexit.register(_end_now)


def _status(code: object) -> int:
    """The process status ``sys.exit(code)`` gives: None is 0, and anything but an int is printed, status 1."""
    return code if isinstance(code, int) else (0 if code is None else 1)


def end_spawned_process_promptly() -> None:
    """In a process multiprocessing spawned (a ``ddp_spawn`` rank): once the exit handlers registered from here on
    have run, end it with its exit status, skipping the teardown. Anywhere else (a forked rank, which
    multiprocessing ends with ``os._exit``; the process that launched the ranks) it does nothing.

    multiprocessing ends a spawned child with ``sys.exit(<status>)`` once its function has ended, however it
    ended (a stop's 128 + signal, 1 after an error that torch's spawn wrapper reported, 0 otherwise). That status
    is known nowhere else, so ``sys.exit`` is wrapped to note it: the last call, which is multiprocessing's, wins.
    It is called after the process's imports, so the handlers they registered would run after this one and are
    skipped with the teardown (torch's and PIL's caches, matplotlib's figures, weakref finalizers whose atexit
    hook an import registered); the handlers of the rank's own work (process group, loggers, DataLoader
    workers) run, and logging is flushed.
    """
    global _noting_sys_exit
    spawned = multiprocessing.parent_process() is not None and multiprocessing.get_start_method(True) == "spawn"
    if not spawned or _noting_sys_exit:
        return
    _noting_sys_exit = True
    exit_ = sys.exit

    def noting_exit(status: object = None) -> NoReturn:
        global _exit_code
        _exit_code = _status(status)
        exit_(status)

    sys.exit = noting_exit
    install()


@contextlib.contextmanager
def exit_code_recorded() -> Iterator[None]:
    """Note how ``main()`` ended, so the prompt exit returns the status the interpreter would have."""
    global _exit_code
    try:
        yield
    except SystemExit as stop:
        _exit_code = _status(stop.code)
        raise
    except KeyboardInterrupt:
        _exit_code = 130
        raise
    except BaseException:
        _exit_code = 1  # the traceback is printed before atexit runs
        raise
    else:
        _exit_code = 0
