"""Run the project's entry points as a user would: ``python src/<script>.py overrides...``, a process of its own.

Starting Python and importing torch, Lightning and torchmetrics takes seconds, most of a short run (a
refusal, a few batches). So each run is forked from a process that made those imports once
(:mod:`tests.helpers.fork_server`, one per test process): the child runs the script as ``__main__`` with its
own argv, environment, working directory, output and exit status. The server's imports saw this process's
environment: when it changes, a new server makes them again. A run given an environment of its own gets a
fresh interpreter; so do the README's commands, in a fresh shell (tests/test_readme_commands.py), and
``TESTS_FRESH_INTERPRETERS=1`` gives every run one.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tests.helpers.config import ROOT


def run_entry(script: str, *overrides: str, timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``python src/<script>.py overrides...`` as a user would; returns the completed process."""
    argv = [sys.executable, str(ROOT / "src" / f"{script}.py"), *overrides]
    server = None if env else _ForkServer.get()
    if server is None:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                              env={**os.environ, **(env or {})})
    return server.run(argv, timeout)


def _import_env() -> dict[str, str]:
    """This process's environment, less what pytest changes for each test (read by no import)."""
    return {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}


class _ForkServer:
    """The client end of one :mod:`tests.helpers.fork_server` process (started on first use)."""

    _instance: _ForkServer | None = None
    _lock = threading.Lock()

    @classmethod
    def get(cls) -> _ForkServer | None:
        if os.environ.get("TESTS_FRESH_INTERPRETERS") == "1":
            return None
        old = cls._instance
        if old is None or old.proc.poll() is not None or old.env != _import_env():
            if old is not None:  # its imports saw another environment: a new server makes them again
                old.proc.stdin.close()
            cls._instance = cls()
        return cls._instance

    def __init__(self) -> None:
        self.env = _import_env()  # what the server's imports saw
        self._pending = b""  # read from the server, not yet a whole line
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.fork_server"], cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        atexit.register(self.proc.stdin.close)  # the server ends when its requests end

    def run(self, argv: list[str], timeout: float) -> subprocess.CompletedProcess:
        """As ``subprocess.run(argv, capture_output=True, text=True, timeout=timeout)``: the output is read to its
        end, which comes when the child and every process it started have closed it."""
        with self._lock, tempfile.TemporaryDirectory(prefix="entry-") as tmp:
            paths = [Path(tmp, "stdout"), Path(tmp, "stderr")]
            readers = {}
            for path in paths:
                os.mkfifo(path)
                readers[os.open(path, os.O_RDONLY | os.O_NONBLOCK)] = path.name
            request = {"argv": argv[1:], "env": dict(os.environ), "cwd": str(ROOT),
                       "stdout": str(paths[0]), "stderr": str(paths[1])}
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            started = self._reply(timeout=120)  # the server's own imports, on its first request
            if started is None:
                raise RuntimeError("the fork server (tests/helpers/fork_server.py) did not start a child in 120 s")
            deadline = time.monotonic() + timeout
            output = _read_to_end(readers, deadline)
            reply = None if readers else self._reply(max(0.0, deadline - time.monotonic()))
            if reply is None:  # as subprocess.run does on a timeout: kill the child, then raise
                with contextlib.suppress(ProcessLookupError):  # it may have ended, its output held by a process it started
                    os.kill(started["pid"], signal.SIGKILL)
                self._reply(timeout=60)
                for fd in readers:
                    os.close(fd)
                raise subprocess.TimeoutExpired(argv, timeout, output=output["stdout"], stderr=output["stderr"])
            return subprocess.CompletedProcess(argv, reply["returncode"], output["stdout"], output["stderr"])

    def _reply(self, timeout: float) -> dict | None:
        """The server's next line, or None when none came within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._pending:
            if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError(f"the fork server (tests/helpers/fork_server.py) ended: exit {self.proc.wait()}")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line)


def _read_to_end(readers: dict[int, str], deadline: float) -> dict[str, str]:
    """Read each pipe of ``readers`` (fd -> name) until its end or ``deadline``; an ended pipe is closed and
    leaves ``readers``. Returns what was read, by name."""
    read = {name: b"" for name in readers.values()}
    while readers:
        ready, _, _ = select.select(list(readers), [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        for fd in ready:
            chunk = os.read(fd, 65536)
            if chunk:
                read[readers[fd]] += chunk
            else:
                os.close(fd)
                del readers[fd]
    # decoded as subprocess.run(text=True) decodes: the locale's encoding, universal newlines
    return {name: io.TextIOWrapper(io.BytesIO(data)).read() for name, data in read.items()}
