"""Run one contender as a subprocess and turn its timelines into numbers.

A contender runs in a pseudo-terminal by default, as ``python src/train.py`` does in a user's shell:
the rich progress bar only draws when its output is a terminal, so a pipe would hide its cost.
The harness notes the launch time; each process of the run writes a
:class:`~scripts.bench.timeline.Timeline`, from which come the steady-state throughput (epochs
after the warm-up ones, each from its ``on_train_epoch_start`` to its last step's end), the time
to the first optimizer step, and each process's peak RSS.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pty
import resource
import signal
import struct
import subprocess
import termios
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from scripts.bench.timeline import rank_path

TERMINAL_SIZE = (40, 120)  # rows, columns of the pseudo-terminal


@dataclass
class Run:
    """One contender's run: what was launched, how long it took, and what its processes recorded."""

    name: str
    cmd: list[str]
    launch_unix: float
    wall_s: float
    returncode: int
    log: Path
    timelines: list[dict] = field(default_factory=list)
    cpu_s: float = 0.0  # CPU time of the contender's processes (user + system)
    # Mean cores busy with other processes during the run (> ~0.2: a disturbed run). Ranks that the
    # contender starts but never waits for (Lightning's DDP launcher) count here too.
    other_load: float = 0.0

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and bool(self.timelines)

    def error(self) -> str:
        tail = self.log.read_text(errors="replace").strip().splitlines()[-3:] if self.log.exists() else []
        return f"{self.name} exited {self.returncode}; log {self.log}: " + " | ".join(tail)


def run(name: str, cmd: list[str], prefix: Path, log: Path, env: dict[str, str], cwd: Path,
        world_size: int = 1, tty: bool = True, timeout: float = 1800) -> Run:
    """Launch ``cmd``, wait for it, then read the ``world_size`` timelines written under ``prefix``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    for rank in range(world_size):
        rank_path(prefix, rank).unlink(missing_ok=True)
    busy_before, own_before = system_busy_s(), _own_cpu_s()
    launch = time.time()
    start = time.perf_counter()
    code, cpu = _run_tty(cmd, log, env, cwd, timeout) if tty else _run_pipe(cmd, log, env, cwd, timeout)
    wall = time.perf_counter() - start
    # Everything busy that was neither the contender nor this harness (which drains the terminal).
    other = max(0.0, (system_busy_s() - busy_before - cpu - (_own_cpu_s() - own_before)) / wall)
    timelines = [json.loads(p.read_text()) for r in range(world_size) if (p := rank_path(prefix, r)).exists()]
    return Run(name, cmd, launch, wall, code, log, timelines if len(timelines) == world_size else [], cpu, other)


def system_busy_s() -> float:
    """CPU seconds all cores have spent busy since boot (``/proc/stat``; 0 where it does not exist)."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def wait_until_quiet(max_wait: float, threshold: float = 0.3, interval: float = 1.0) -> float:
    """Wait (at most ``max_wait`` s) until other processes use under ``threshold`` cores; return the last load."""
    deadline = time.monotonic() + max_wait
    while True:
        before = system_busy_s()
        time.sleep(interval)
        load = (system_busy_s() - before) / interval
        if load < threshold or time.monotonic() >= deadline:
            return load


def _run_pipe(cmd, log: Path, env, cwd, timeout: float) -> tuple[int, float]:
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                env=env, cwd=cwd, start_new_session=True)
        return _wait(proc, timeout)


def _run_tty(cmd, log: Path, env, cwd, timeout: float) -> tuple[int, float]:
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", *TERMINAL_SIZE, 0, 0))
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave,
                                env=env, cwd=cwd, start_new_session=True)
        os.close(slave)
        # Drain the terminal as a real one would, so the child never blocks on a full buffer.
        reader = threading.Thread(target=_drain, args=(master, out), daemon=True)
        reader.start()
        result = _wait(proc, timeout)
        reader.join(timeout=10)
    os.close(master)
    return result


def _drain(fd: int, out) -> None:
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO once every writer has closed the terminal
            return
        if not chunk:
            return
        out.write(chunk)


def _wait(proc: subprocess.Popen, timeout: float) -> tuple[int, float]:
    """Wait for ``proc``; return its exit code and the CPU seconds it and its waited-for children used."""
    timer = threading.Timer(timeout, _kill_session, args=(proc.pid,))
    timer.start()
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    finally:
        timer.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, so Popen must not wait again
    return proc.returncode, usage.ru_utime + usage.ru_stime


def _kill_session(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)  # the session this harness started for the contender


# -- numbers from timelines ---------------------------------------------------------------------
def steady_throughput(r: Run, warmup_epochs: int = 1) -> float:
    """Samples/s over all ranks in the epochs after ``warmup_epochs``: sum of samples / sum of epoch spans.

    An epoch's span runs from its start (before the loader is iterated) to its last step's end; with
    several ranks the slowest rank's span counts (they step together).
    """
    epochs = len(r.timelines[0]["epochs"])
    if epochs <= warmup_epochs:
        raise ValueError(f"{r.name}: {epochs} epochs recorded, need more than {warmup_epochs} warm-up epochs")
    samples = spans = 0.0
    for e in range(warmup_epochs, epochs):
        per_rank = [t["epochs"][e] for t in r.timelines]
        samples += sum(ep["samples"] for ep in per_rank)
        spans += max(ep["steps"][-1] - ep["start"] for ep in per_rank)
    return samples / spans


def epoch_wall_s(r: Run, warmup_epochs: int = 1) -> float | None:
    """Mean time from one epoch's start to the next one's (training plus validation), after the warm-up."""
    starts = [ep["start"] for ep in r.timelines[0]["epochs"]][warmup_epochs:]
    return (starts[-1] - starts[0]) / (len(starts) - 1) if len(starts) > 1 else None


def train_samples(r: Run) -> int:
    return int(sum(ep["samples"] for t in r.timelines for ep in t["epochs"]))


def first_step_s(r: Run) -> float:
    """Seconds from the launch to the first optimizer step (the last rank to take it)."""
    return max(t["first_step_unix"] for t in r.timelines) - r.launch_unix


def peak_rss_mb(r: Run) -> list[float]:
    """Peak RSS of each rank's process, MiB."""
    return [t["peak_rss_mb"] for t in r.timelines]


def peak_cuda_mb(r: Run) -> float | None:
    """Peak CUDA memory allocated by rank 0's process, MiB (``None`` for a CPU run)."""
    return r.timelines[0].get("peak_cuda_mb")


def threads(r: Run) -> list[int]:
    return [t["threads"] for t in r.timelines]


def test_metric(r: Run, key: str = "test/acc") -> float | None:
    value = r.timelines[0].get("test_metrics", {}).get(key)
    return None if value is None else float(value)
