"""A process that has imported the entry points once and forks one child per run of ``src/<script>.py``.

Started by :mod:`tests.helpers.entry`, one per test process, as ``python -m tests.helpers.fork_server``. It
reads one JSON request per line on stdin (``argv``, ``env``, ``cwd``, ``stdout``, ``stderr``: paths of named
pipes or files; ``session``: start the child in a session of its own; ``ignored_signals``: signal name -> whether the
client ignores it, as a fresh interpreter of its own would inherit it) and answers on its own stdout with one
JSON line ``{"pid": ...}`` when a child started, and one ``{"pid": ..., "returncode": ...}`` when it ended
(negative: the signal that ended it, as :mod:`subprocess` says it). Several children may run at once.

The child is what ``python src/<script>.py`` would be: the script runs as ``__main__`` with its argv,
environment, working directory, stdin ``/dev/null`` and the client's two outputs, and it ends through the
interpreter's own exit (atexit handlers, then the script's prompt exit, which ``install()`` registered before
the imports, as the script's first lines do). Only Python's start-up and these imports are skipped.

Hand-written because multiprocessing's forkserver leaves its own state in the child (a parent process, a
process name, os._exit without atexit), which the entry points would see and a user's process would not.
"""

from __future__ import annotations

import json
import os
import runpy
import select
import signal
import sys
import tempfile
import time

from src.engine.runtime import prompt_exit

prompt_exit.install()  # first, as the entry points do: their prompt exit runs after every other atexit handler


def _imported_with_output_kept() -> tuple[bytes, bytes]:
    """Import every entry point's modules; what the imports printed on stdout and stderr, for each child."""
    saved = [os.dup(1), os.dup(2)]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            import src.eval  # noqa: F401
            import src.export  # noqa: F401
            import src.predict  # noqa: F401
            import src.train  # noqa: F401
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, copy in zip((1, 2), saved, strict=True):
                os.dup2(copy, fd)
                os.close(copy)
        return tuple(os.pread(f.fileno(), os.fstat(f.fileno()).st_size, 0) for f in (out, err))


IMPORT_OUTPUT = _imported_with_output_kept()


def _run_child(request: dict, outputs: tuple[int, int], channels: tuple[int, ...], in_session: int | None) -> None:
    """In the forked child: become ``python <argv>`` and run it; never returns (the script's exit ends it)."""
    for channel in channels:
        os.close(channel)
    if in_session is not None:  # as Popen(start_new_session=True): a kill of its process group reaches all it starts
        os.setsid()
        os.write(in_session, b"1")  # before the server says the child started
        os.close(in_session)
    stdin = os.open(os.devnull, os.O_RDONLY)
    os.dup2(stdin, 0)
    os.close(stdin)
    for fd, output in zip((1, 2), outputs, strict=True):
        os.dup2(output, fd)
        os.close(output)
    for fd, printed in zip((1, 2), IMPORT_OUTPUT, strict=True):  # a fresh interpreter's imports print it first
        with open(fd, "wb", closefd=False) as stream:
            stream.write(printed)
    _fresh_random_state()
    for name, ignored in request["ignored_signals"].items():  # as a fresh interpreter of the client's would have them
        default = signal.default_int_handler if name == "SIGINT" else signal.SIG_DFL
        signal.signal(getattr(signal, name), signal.SIG_IGN if ignored else default)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.argv = request["argv"]
    sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))  # as `python <script>` sets it
    prompt_exit.install = lambda: None  # ran above, before the imports, where the script runs it
    runpy.run_path(sys.argv[0], run_name="__main__")
    sys.exit(0)  # a script that returned: the interpreter's exit, atexit handlers included


def _fresh_random_state() -> None:
    """The random generators as a fresh interpreter starts them: torch's default one at its initial seed, numpy's
    from the OS (Python's ``random`` reseeds itself after a fork)."""
    import numpy as np
    import torch

    torch.manual_seed(torch.initial_seed())
    np.random.seed()


def main() -> None:
    requests, replies = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):  # the channels stay off the standard streams a child inherits
        os.dup2(devnull, fd)
    os.close(devnull)
    children: set[int] = set()
    pending, open_ = b"", True

    def reply(message: dict) -> None:
        os.write(replies, (json.dumps(message) + "\n").encode())

    while open_ or children:
        # poll for ended children while any run; otherwise sleep until a request comes
        if open_ and select.select([requests], [], [], 0.02 if children else None)[0]:
            chunk = os.read(requests, 65536)
            open_ = bool(chunk)  # the client closed its end: serve the children that run, then end
            pending += chunk
        elif not open_:
            time.sleep(0.02)
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            sys.stdout.flush()
            sys.stderr.flush()
            # the client's outputs, opened here so that the child (and whatever it starts) holds them from the
            # start: the client reads named pipes to their end, as subprocess.run reads its pipes
            outputs = (os.open(request["stdout"], os.O_WRONLY), os.open(request["stderr"], os.O_WRONLY))
            told, in_session = os.pipe() if request.get("session") else (None, None)
            pid = os.fork()
            if pid == 0:
                _run_child(request, outputs, (requests, replies, *([told] if told else [])), in_session)
            for output in outputs:
                os.close(output)
            if told is not None:
                os.close(in_session)
                os.read(told, 1)  # the child leads its own session: a kill of its group reaches it
                os.close(told)
            children.add(pid)
            reply({"pid": pid})
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            reply({"pid": pid, "returncode": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    main()
