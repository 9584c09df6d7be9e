"""Processes a test starts and waits on: each wait is bounded, a timeout says what was awaited and what each
process last printed, and every process started (and all it started) is ended on the way out, pass or fail.

    with Processes() as procs:
        node0 = procs.start("node 0", [...], log=tmp_path / "node0.log", env=env)
        node1 = procs.start("node 1", [...], log=tmp_path / "node1.log", env=env)
        codes = procs.wait(300, "both nodes to finish training")
    # here every process of both nodes has ended, whatever happened above

Each process gets stdin ``/dev/null`` (never the test runner's), its own session (a kill reaches its process
group) and one log file for stdout and stderr, opened before it starts (never a pipe: a pipe nobody reads fills
and blocks the writer, and with it every rank waiting on that one). Ending them walks the process tree as well
as the sessions, because launchers such as torchrun start their ranks in sessions of their own.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import psutil


def free_port() -> int:
    """A TCP port free on this machine now, below the kernel's ephemeral range.

    A port from ``bind(port 0)`` (``find_free_network_port``) lies in the ephemeral range, which the kernel keeps
    handing out, to every process, for outgoing connections and other port-0 binds: between the pick and the bind
    by the rendezvous host, a test running beside this one may get it. One below that range is only ever taken
    by a process that asks for it by number.
    """
    try:
        first = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        first = 32768  # Linux's default start of the range
    low, high = max(10000, first - 12000), first - 1
    for _ in range(200):
        port = random.randint(low, high) if high > low else 0
        if 29400 <= port <= 29600:  # torch's default ports, taken by runs that name none
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError(f"no free TCP port in {low}-{high}")


def tail(path: Path, lines: int = 30) -> str:
    """The last ``lines`` lines of a log ("(empty)" when it has nothing, "(missing)" when it does not exist)."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return "(missing)"
    return "\n".join(text.splitlines()[-lines:]) if text else "(empty: nothing printed)"


class Processes:
    """A test's processes, by name. Use as a context manager: leaving it ends every one of them."""

    def __init__(self) -> None:
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}
        self._seen: dict[str, dict[int, psutil.Process]] = {}  # descendants seen, by name: ranks outlive a launcher

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc) -> None:
        self.end()

    def start(self, name: str, command: list[str], log: Path, **popen) -> subprocess.Popen:
        """Start ``command`` (stdout and stderr to ``log``); ``popen``: more arguments for Popen (env, cwd)."""
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as out:  # opened before the start: the child holds its own descriptor from its first line
            proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True, **popen)
        self.procs[name], self.logs[name], self._seen[name] = proc, log, {}
        self._track()
        return proc

    def output(self, name: str) -> str:
        return self.logs[name].read_text(errors="replace")

    def wait(self, timeout: float, what: str, names: list[str] | None = None) -> dict[str, int]:
        """Wait until each process (of ``names``; default: all) has ended, at most ``timeout`` seconds in all;
        their exit codes. On a timeout the test fails saying ``what`` it waited for and each process's state and
        last lines."""
        names = list(self.procs) if names is None else names
        self.wait_for(lambda: all(self.procs[n].poll() is not None for n in names), timeout, what)
        return {n: self.procs[n].returncode for n in names}

    def wait_for(self, condition: Callable[[], bool], timeout: float, what: str) -> None:
        """Poll ``condition`` until it holds, at most ``timeout`` seconds; on a timeout the test fails saying
        ``what`` it waited for and each process's state and last lines."""
        deadline = time.monotonic() + timeout
        while not (self._track() or condition()):
            if time.monotonic() >= deadline:
                raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{self.report()}")
            time.sleep(0.2)

    def report(self, lines: int = 30) -> str:
        """Each process: running or its exit code, where each of its processes sits, and its log's last lines."""
        parts = []
        for name, proc in self.procs.items():
            state = "running" if proc.poll() is None else f"exit {proc.returncode}"
            command = proc.args if isinstance(proc.args, str) else " ".join(map(str, proc.args))
            parts.append(f"--- {name} (pid {proc.pid}, {state}): {command[:300]}")
            parts.extend(f"    {line}" for line in self._tree(name))
            parts.append(f"--- {name}: last lines of {self.logs[name]}:\n{tail(self.logs[name], lines)}")
        return "\n".join(parts)

    def end(self) -> None:
        """SIGKILL every process started here and every process they started (sessions and tree); reap them."""
        self._track()
        victims = [p for seen in self._seen.values() for p in seen.values() if _alive(p)]
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
        for p in victims:
            with contextlib.suppress(psutil.Error, OSError):
                if p.pid == os.getpgid(p.pid):  # a session leader (a torchrun rank): its own group too
                    os.killpg(p.pid, signal.SIGKILL)
            with contextlib.suppress(psutil.Error, OSError):
                p.kill()
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
        psutil.wait_procs(victims, timeout=30)

    def _track(self) -> None:
        for name, proc in self.procs.items():
            with contextlib.suppress(psutil.Error):
                for child in psutil.Process(proc.pid).children(recursive=True):
                    self._seen[name].setdefault(child.pid, child)

    def _tree(self, name: str) -> list[str]:
        try:
            root = psutil.Process(self.procs[name].pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            procs = []
        procs += [p for p in self._seen[name].values() if p not in procs and _alive(p)]  # its orphans too
        out = []
        for p in procs:
            with contextlib.suppress(psutil.Error):
                wchan = Path(f"/proc/{p.pid}/wchan").read_text() if Path(f"/proc/{p.pid}/wchan").exists() else "?"
                out.append(f"pid {p.pid} ({p.status()}, in {wchan or '?'}): {' '.join(p.cmdline())[:200]}")
        return out


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE  # is_running: the same process, not a reused PID
    except psutil.Error:
        return False
