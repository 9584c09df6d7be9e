"""Run the project's entry points as a user would: ``python src/<script>.py overrides...``, a process of its own.

Starting Python and importing torch, Lightning and torchmetrics takes seconds, most of a short run (a
refusal, a few batches). So each run is forked from a process that made those imports once
(:mod:`tests.helpers.fork_server`, one per test process): the child runs the script as ``__main__`` with its
own argv, environment, working directory, output and exit status. The server's imports saw this process's
environment: when it changes, a new server makes them again. A run given an environment of its own gets a
fresh interpreter, and ``TESTS_FRESH_INTERPRETERS=1`` gives every run one. :func:`forked` starts a run the same
way without waiting for it (:func:`tests.helpers.training_runs.launch`, for the runs a test kills).
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

INHERITED_SIGNALS = (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP)  # what a shell may leave ignored


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


def forked(command: list[str]) -> ForkedRun | None:
    """Start ``command`` (``python src/<script>.py ...``) through the fork server, in a session of its own, its
    stdout discarded and its stderr written to ``stderr_file``; None where it needs a fresh interpreter."""
    script = Path(command[1]) if len(command) > 1 else None
    if not (command[0] == sys.executable and script and script.parent == ROOT / "src" and script.stem in SCRIPTS):
        return None
    server = _ForkServer.get()
    if server is None:
        return None
    err = tempfile.NamedTemporaryFile(mode="w+", prefix="launch-", suffix=".err")  # noqa: SIM115 - the run's
    pid = server.start(command, os.devnull, err.name, session=True)
    return ForkedRun(server, command, pid, err)


SCRIPTS = ("train", "eval", "predict", "export")  # what the fork server has imported


class ForkedRun:
    """A run :func:`forked` started, with what the tests use of :class:`subprocess.Popen`."""

    def __init__(self, server: _ForkServer, args: list[str], pid: int, stderr_file) -> None:
        self._server, self.args, self.pid, self.stderr_file = server, args, pid, stderr_file
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.returncode(self.pid, timeout=0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._server.returncode(self.pid, float("inf") if timeout is None else timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class _ForkServer:
    """The client end of one :mod:`tests.helpers.fork_server` process (started on first use)."""

    _instance: _ForkServer | None = None

    @classmethod
    def get(cls) -> _ForkServer | None:
        if os.environ.get("TESTS_FRESH_INTERPRETERS") == "1":
            return None
        old = cls._instance
        if old is None or old.proc.poll() is not None or old.env != _import_env():
            if old is not None:  # its imports saw another environment: a new server makes them again
                old.proc.stdin.close()  # it ends once the children it runs have ended
            cls._instance = cls()
        return cls._instance

    def __init__(self) -> None:
        self.env = _import_env()  # what the server's imports saw
        self._pending = b""  # read from the server, not yet a whole line
        self._ended: dict[int, int] = {}  # pid -> exit code, read from the server, not yet asked for
        self._lock = threading.Lock()  # one thread writes requests and reads replies at a time
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.fork_server"], cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        atexit.register(self.proc.stdin.close)  # the server ends when its requests and children end

    def start(self, argv: list[str], stdout: str, stderr: str, session: bool = False) -> int:
        """Fork a child that runs ``argv`` (writing to the files or named pipes ``stdout`` and ``stderr``): its pid."""
        # a signal this process ignores stays ignored in an interpreter it starts (a suite started in the background
        # ignores SIGINT): the forked child takes this process's, not the server's
        ignored = {s.name: signal.getsignal(s) is signal.SIG_IGN for s in INHERITED_SIGNALS}
        request = {"argv": argv[1:], "env": dict(os.environ), "cwd": str(ROOT), "stdout": stdout, "stderr": stderr,
                   "session": session, "ignored_signals": ignored}
        with self._lock:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            deadline = time.monotonic() + 120  # the server's own imports, on its first request
            while (reply := self._reply(max(0.0, deadline - time.monotonic()))) is not None:
                if "returncode" not in reply:
                    return reply["pid"]
                self._ended[reply["pid"]] = reply["returncode"]
        raise RuntimeError("the fork server (tests/helpers/fork_server.py) did not start a child in 120 s")

    def returncode(self, pid: int, timeout: float) -> int | None:
        """The exit code of child ``pid``, once it ends within ``timeout`` seconds (None: it still runs)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if pid in self._ended:
                    return self._ended.pop(pid)
                reply = self._reply(min(0.05, max(0.0, deadline - time.monotonic())))
                if reply is not None:
                    self._ended[reply["pid"]] = reply["returncode"]  # starts are read by start(), under the lock
                    continue
            if time.monotonic() >= deadline:
                return None

    def run(self, argv: list[str], timeout: float) -> subprocess.CompletedProcess:
        """As ``subprocess.run(argv, capture_output=True, text=True, timeout=timeout)``: the output is read to its
        end, which comes when the child and every process it started have closed it."""
        with tempfile.TemporaryDirectory(prefix="entry-") as tmp:
            paths = [Path(tmp, "stdout"), Path(tmp, "stderr")]
            readers = {}
            for path in paths:
                os.mkfifo(path)
                readers[os.open(path, os.O_RDONLY | os.O_NONBLOCK)] = path.name
            pid = self.start(argv, str(paths[0]), str(paths[1]))
            deadline = time.monotonic() + timeout
            output = _read_to_end(readers, deadline)
            code = None if readers else self.returncode(pid, max(0.0, deadline - time.monotonic()))
            if code is None:  # as subprocess.run does on a timeout: kill the child, then raise
                with contextlib.suppress(ProcessLookupError):  # it may have ended, its output held by a process it started
                    os.kill(pid, signal.SIGKILL)
                self.returncode(pid, timeout=60)
                for fd in readers:
                    os.close(fd)
                raise subprocess.TimeoutExpired(argv, timeout, output=output["stdout"], stderr=output["stderr"])
            return subprocess.CompletedProcess(argv, code, output["stdout"], output["stderr"])

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
