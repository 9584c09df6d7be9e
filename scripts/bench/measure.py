"""Run one contender as a subprocess and turn what the kernel and its timelines say into numbers.

A contender runs in a pseudo-terminal by default, as ``python src/train.py`` does in a user's shell:
the rich progress bar only draws when its output is a terminal, so a pipe would hide its cost.
It runs in a session of its own. While it runs, the harness polls ``/proc`` every 0.2 s for the
session's processes (DDP ranks, DataLoader workers, ranks a launcher never waits for), keeping each
one's last CPU time and memory high-water mark (``VmHWM``). When the contender exits, ``wait4``
gives its exit status and the kernel's peak RSS of the whole process (teardown included; the max
over it and the children it waited for); the harness then waits for the rest of the session.

Linux keeps ``ru_maxrss`` across ``execve``, and a forked child starts with its parent's RSS as its
high-water mark, so a contender forked straight from this harness (torch and the data loaded) would
report at least the harness's RSS. A small launcher (:data:`LAUNCHER`, a bare interpreter) is
therefore started first; it forks and execs the contender, ``wait4``s for it and reports its rusage.
Each process of the run also writes a :class:`~scripts.bench.timeline.Timeline`, from which come the
whole-epoch and training-loop throughputs (epochs after the warm-up one) and the time to the first
optimizer step.
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
import sys
import termios
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from scripts.bench.timeline import rank_path

TERMINAL_SIZE = (40, 120)  # rows, columns of the pseudo-terminal
POLL_S = 0.2  # how often the session's processes are read from /proc
ORPHAN_WAIT_S = 60.0  # how long processes may outlive the launched one before the session is killed
# argv: result file, then the contender's command. Forks from a ~10 MiB interpreter, so the
# contender's ru_maxrss starts from that, not from the harness's RSS.
LAUNCHER = """
import json, os, sys
pid = os.fork()
if pid == 0:
    try:
        os.execvp(sys.argv[2], sys.argv[2:])
    except OSError as err:
        print(f"cannot run {sys.argv[2]}: {err}", file=sys.stderr, flush=True)
    os._exit(127)
_, status, ru = os.wait4(pid, 0)
with open(sys.argv[1], "w") as f:
    json.dump({"pid": pid, "status": status, "maxrss": ru.ru_maxrss, "cpu_s": ru.ru_utime + ru.ru_stime}, f)
"""


@dataclass
class Run:
    """One contender's run: what was launched, how long it took, and what its processes recorded."""

    name: str
    cmd: list[str]
    launch_unix: float
    wall_s: float  # launch to the launched process's exit
    returncode: int
    log: Path
    timelines: list[dict] = field(default_factory=list)
    cpu_s: float = 0.0  # CPU time (user + system) of every process of the contender's session
    # Mean cores busy with processes other than the contender's session and this harness during
    # the run (> ~0.2: a disturbed run).
    other_load: float = 0.0
    pid: int = 0  # the contender's process (the command's own, under the launcher)
    max_rss_mb: float = 0.0  # wait4's ru_maxrss: the contender's process and the children it waited for
    # Every process of the session but the launcher: pid -> last seen {"cpu_s", "hwm_mb", "ppid"}
    processes: dict[int, dict] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and bool(self.timelines)

    def error(self) -> str:
        tail = self.log.read_text(errors="replace").strip().splitlines()[-3:] if self.log.exists() else []
        return f"{self.name} exited {self.returncode}; log {self.log}: " + " | ".join(tail)


@dataclass
class _Exit:
    code: int
    wall_s: float  # launch to the launched process's exit
    cpu_s: float  # wait4: the launched process and its waited-for descendants
    max_rss_mb: float  # wait4's ru_maxrss, MiB
    pid: int
    session: SessionMonitor


def run(name: str, cmd: list[str], prefix: Path, log: Path, env: dict[str, str], cwd: Path,
        world_size: int = 1, tty: bool = True, timeout: float = 1800) -> Run:
    """Launch ``cmd``, wait for its whole session, then read the ``world_size`` timelines written under ``prefix``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    for rank in range(world_size):
        rank_path(prefix, rank).unlink(missing_ok=True)
    busy_before, own_before = system_busy_s(), _own_cpu_s()
    launch = time.time()
    start = time.perf_counter()
    result = log.with_name(f"{log.name}.exit.json")
    result.unlink(missing_ok=True)
    launcher = [sys.executable, "-I", "-S", "-c", LAUNCHER, str(result), *cmd]
    done = (_run_tty if tty else _run_pipe)(launcher, log, env, cwd, timeout, result)
    span = time.perf_counter() - start  # until the whole session has gone
    # wait4 is exact for the launcher, the contender and what it waited for; the poll also sees the rest.
    cpu = max(done.cpu_s, done.session.cpu_s())
    other = max(0.0, (system_busy_s() - busy_before - cpu - (_own_cpu_s() - own_before)) / span)
    timelines = [json.loads(p.read_text()) for r in range(world_size) if (p := rank_path(prefix, r)).exists()]
    return Run(name, cmd, launch, done.wall_s, done.code, log, timelines if len(timelines) == world_size else [],
               cpu, other, done.pid, done.max_rss_mb, done.session.processes())


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


class SessionMonitor:
    """Polls ``/proc`` for the processes of session ``sid``: each one's last CPU time and peak RSS.

    Every ``interval`` s (in a thread, from :meth:`start` to :meth:`stop`) it reads ``/proc/*/stat``
    and keeps, per process, the last ``utime + stime`` seen (its own CPU, not its children's, so
    nothing is counted twice) and the last ``VmHWM`` of ``/proc/<pid>/status``. A process's last
    ``interval`` before its exit is not seen.
    """

    def __init__(self, sid: int, interval: float = POLL_S) -> None:
        self.sid, self.interval = sid, interval
        self._seen: dict[tuple[int, int], dict] = {}  # (pid, start time) -> record
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._tick = os.sysconf("SC_CLK_TCK")
        self._lock = threading.Lock()  # the poll thread, the waiting thread and a timeout's kill
        self._alive: list[int] = []

    def start(self) -> SessionMonitor:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.poll()

    def _loop(self) -> None:
        while True:
            self.poll()
            if self._stop.wait(self.interval):
                return

    def poll(self) -> int:
        """Read the session's processes now; return how many are alive (zombies not counted)."""
        with self._lock:
            return self._poll()

    def _poll(self) -> int:
        alive = []
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                stat = Path(entry.path, "stat").read_text()
            except OSError:  # gone meanwhile
                continue
            fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "; comm may hold spaces
            if int(fields[3]) != self.sid:  # field 6: session id
                continue
            pid = int(entry.name)
            record = self._seen.setdefault((pid, int(fields[19])), {"pid": pid, "cpu_s": 0.0, "hwm_mb": 0.0})
            record["ppid"] = int(fields[1])
            record["cpu_s"] = (int(fields[11]) + int(fields[12])) / self._tick  # utime + stime
            if fields[0] not in "ZXx":  # zombie or dead: nothing left to run or to measure
                alive.append(pid)
                record["hwm_mb"] = max(record["hwm_mb"], _vm_hwm_mb(pid))
        self._alive = alive
        return len(alive)

    def kill(self) -> None:
        """SIGKILL the session's process group and every other process of the session still alive."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.sid, signal.SIGKILL)
        self.poll()
        for pid in self._alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def wait_empty(self, timeout: float) -> bool:
        """Wait until no process of the session is alive (``False``: still some after ``timeout`` s)."""
        deadline = time.monotonic() + timeout
        while self.poll():
            if time.monotonic() >= deadline:
                return False
            time.sleep(self.interval)
        return True

    def cpu_s(self) -> float:
        return sum(r["cpu_s"] for r in self._seen.values())

    def processes(self) -> dict[int, dict]:
        """pid -> ``{"cpu_s", "hwm_mb", "ppid"}`` of all but the session leader (the launcher)."""
        return {r["pid"]: {k: v for k, v in r.items() if k != "pid"} for r in self._seen.values()
                if r["pid"] != self.sid}


def _vm_hwm_mb(pid: int) -> float:
    """``VmHWM`` (peak RSS) of ``/proc/<pid>/status`` in MiB; 0 when unreadable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return 0.0


def _run_pipe(cmd, log: Path, env, cwd, timeout: float, result: Path) -> _Exit:
    with open(log, "wb") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                env=env, cwd=cwd, start_new_session=True)
        return _wait(proc, timeout, start, result)


def _run_tty(cmd, log: Path, env, cwd, timeout: float, result: Path) -> _Exit:
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", *TERMINAL_SIZE, 0, 0))
    with open(log, "wb") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave,
                                env=env, cwd=cwd, start_new_session=True)
        os.close(slave)
        # Drain the terminal as a real one would, so the child never blocks on a full buffer.
        reader = threading.Thread(target=_drain, args=(master, out), daemon=True)
        reader.start()
        done = _wait(proc, timeout, start, result)
        reader.join(timeout=10)
    os.close(master)
    return done


def _drain(fd: int, out) -> None:
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO once every writer has closed the terminal
            return
        if not chunk:
            return
        out.write(chunk)


def _wait(proc: subprocess.Popen, timeout: float, start: float, result: Path) -> _Exit:
    """Wait for the launcher ``proc``, then for the rest of its session (killed if it lingers).

    The contender's exit status, pid, CPU time and ``ru_maxrss`` come from the launcher's ``result``
    file; without one (the launcher was killed), from the launcher's own ``wait4``.
    """
    monitor = SessionMonitor(proc.pid).start()
    timer = threading.Timer(timeout, monitor.kill)
    timer.start()
    try:
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        if not monitor.wait_empty(ORPHAN_WAIT_S):
            monitor.kill()
            monitor.wait_empty(10)
    finally:
        timer.cancel()
        monitor.stop()
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, so Popen must not wait again
    cpu = usage.ru_utime + usage.ru_stime  # the launcher, the contender and what the contender waited for
    try:
        child = json.loads(result.read_text())
    except (OSError, ValueError):
        return _Exit(proc.returncode or -signal.SIGKILL, wall, cpu, _maxrss_mb(usage.ru_maxrss), proc.pid, monitor)
    return _Exit(os.waitstatus_to_exitcode(child["status"]), wall, cpu, _maxrss_mb(child["maxrss"]), child["pid"],
                 monitor)


def _maxrss_mb(maxrss: int) -> float:
    """``ru_maxrss`` in MiB: KiB on Linux (bytes on macOS)."""
    return maxrss / 1024 if sys.platform != "darwin" else maxrss / 2**20


# -- numbers from timelines ---------------------------------------------------------------------
def epoch_throughput(r: Run, warmup_epochs: int = 1) -> float | None:
    """Training samples/s over all ranks in whole epochs after ``warmup_epochs`` (the headline rate).

    A whole epoch runs from its start to the next one's (the last: to its end stamp), so it holds
    validation, the checkpoint save, logging and whatever else the run does per epoch. With several
    ranks the slowest rank's span counts. ``None`` when the last epoch has no end stamp.
    """
    span = _whole_epochs_s(r, warmup_epochs)
    return _measured_samples(r, warmup_epochs) / span if span else None


def loop_throughput(r: Run, warmup_epochs: int = 1) -> float:
    """Training samples/s over all ranks, training loop only: each epoch from its start to its last step's end.

    Epochs after ``warmup_epochs``; with several ranks the slowest rank's span counts (they step together).
    """
    samples = spans = 0.0
    for e in range(warmup_epochs, _epochs(r, warmup_epochs)):
        per_rank = [t["epochs"][e] for t in r.timelines]
        samples += sum(ep["samples"] for ep in per_rank)
        spans += max(ep["steps"][-1] - ep["start"] for ep in per_rank)
    return samples / spans


def epoch_wall_s(r: Run, warmup_epochs: int = 1) -> float | None:
    """Mean whole-epoch seconds (training, validation, checkpoint) after the warm-up; the slowest rank."""
    span = _whole_epochs_s(r, warmup_epochs)
    return span / (_epochs(r, warmup_epochs) - warmup_epochs) if span else None


def _epochs(r: Run, warmup_epochs: int) -> int:
    epochs = min(len(t["epochs"]) for t in r.timelines)
    if epochs <= warmup_epochs:
        raise ValueError(f"{r.name}: {epochs} epochs recorded, need more than {warmup_epochs} warm-up epochs")
    return epochs


def _measured_samples(r: Run, warmup_epochs: int) -> float:
    last = _epochs(r, warmup_epochs)
    return sum(ep["samples"] for t in r.timelines for ep in t["epochs"][warmup_epochs:last])


def _whole_epochs_s(r: Run, warmup_epochs: int) -> float | None:
    """Start of the first measured epoch to the end of the last one, on the slowest rank."""
    last = _epochs(r, warmup_epochs) - 1
    spans = []
    for t in r.timelines:
        epochs = t["epochs"]
        end = epochs[last + 1]["start"] if last + 1 < len(epochs) else epochs[last].get("end")
        if end is None:
            return None
        spans.append(end - epochs[warmup_epochs]["start"])
    return max(spans)


def train_samples(r: Run) -> int:
    return int(sum(ep["samples"] for t in r.timelines for ep in t["epochs"]))


def first_step_s(r: Run) -> float:
    """Seconds from the launch to the first optimizer step (the last rank to take it)."""
    return max(t["first_step_unix"] for t in r.timelines) - r.launch_unix


def peak_rss_mb(r: Run) -> float:
    """Peak RSS of the whole launched process, MiB: the kernel's high-water mark from ``wait4``.

    Teardown included; the max over it and any children it waited for (for ``plain_ddp``, whose
    ``mp.spawn`` joins its ranks, the largest rank or the launcher).
    """
    return r.max_rss_mb


def rank_peak_rss_mb(r: Run) -> list[float | None]:
    """Peak RSS of each rank's process, MiB: ``wait4`` for the launched process, ``VmHWM`` polled for the others.

    The poll misses growth in a rank's last 0.2 s; ``None`` where a rank's process was never seen.
    """
    out: list[float | None] = []
    for t in r.timelines:
        seen = r.processes.get(t["pid"], {}).get("hwm_mb")
        out.append(r.max_rss_mb if t["pid"] == r.pid else seen or None)
    return out


def peak_cuda_mb(r: Run) -> float | None:
    """Peak CUDA memory allocated by rank 0's process, MiB (``None`` for a CPU run)."""
    return r.timelines[0].get("peak_cuda_mb")


def threads(r: Run) -> list[int]:
    return [t["threads"] for t in r.timelines]


def test_metric(r: Run, key: str = "test/acc") -> float | None:
    value = r.timelines[0].get("test_metrics", {}).get(key)
    return None if value is None else float(value)
