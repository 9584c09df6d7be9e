"""What a suite gets (settings, a way to run contenders) and what it returns (a table, goals, notes)."""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from scripts.bench import contenders, measure
from scripts.bench.contenders import ROOT


@dataclass(frozen=True)
class Settings:
    rounds: int  # how many times each contender runs, alternating (A B C, A B C, ...)
    epochs: int  # epochs of the throughput and DDP runs (the first is warm-up and not counted)
    limit_train_batches: int  # steps per epoch of those runs; 0 = whole epochs
    accuracy_epochs: int
    threads: int  # torch threads of every single-process contender
    workers: tuple[int, ...]  # DataLoader workers tried for the per-sample pipeline
    nproc: int  # ranks of the DDP comparison
    tty: bool  # run contenders in a pseudo-terminal (as a user's shell does)
    full: bool
    quiet_wait: float = 20.0  # before each run, wait up to this long for other processes to go idle
    batch_size: int | None = None  # global batch of the throughput/DDP runs; None = the config's
    accelerator: str = "cpu"  # of the throughput, start-up and accuracy contenders: cpu | gpu
    precision: str = "32-true"  # of the same contenders: 32-true | bf16-mixed
    device: str = ""  # the device's name (CPU model or GPU name), for the report
    paired: bool = True  # the throughput suite's paired-step runs (bare Lightning and project)
    profile: bool = True  # the throughput suite's profiled runs on a GPU (one extra run per contender)
    workload: str = "mlp"  # of the throughput and start-up suites: mlp (Fashion-MNIST) | resnet18 (CIFAR-10-shaped)
    variants: tuple[tuple[str, tuple[str, ...]], ...] = ()  # throughput: extra project runs, (name, overrides)

    def on_device(self) -> dict[str, str]:
        """The accelerator, precision and workload every single-process contender gets (``contenders.Work``)."""
        return {"accelerator": self.accelerator, "precision": self.precision, "workload": self.workload}

    def device_label(self) -> str:
        """E.g. ``gpu (NVIDIA H100 80GB HBM3), bf16-mixed``, for suite titles."""
        name = f" ({self.device})" if self.device else ""
        return f"{self.accelerator}{name}, {self.precision}"


@dataclass
class Goal:
    text: str
    measured: str
    met: bool | None  # None: not measured in this run


@dataclass
class SuiteResult:
    name: str
    title: str
    columns: list[str] = field(default_factory=list)
    rows: list[list[str]] = field(default_factory=list)
    goals: list[Goal] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    raw: dict = field(default_factory=dict)
    plots: list[str] = field(default_factory=list)  # file names in the results directory
    markdown: str = ""  # extra Markdown (e.g. another benchmark's own table)

    def successful(self, name: str, runs: list[measure.Run]) -> list[measure.Run]:
        """The runs of contender ``name`` that finished; if none did, a 'failed' row and the first error."""
        ok = [run for run in runs if run.ok]
        if not ok:
            self.rows.append([name, "-", "failed", *["-"] * (len(self.columns) - 3)])
            self.notes.append(runs[0].error())
        return ok


class Bench:
    """Runs contenders for the suites: logs in ``<out>/logs``, timelines in ``<out>/timelines``."""

    def __init__(self, out: Path, settings: Settings) -> None:
        self.out = out
        self.settings = settings
        self.runs: list[measure.Run] = []
        (out / "logs").mkdir(parents=True, exist_ok=True)

    def run(self, name: str, make_cmd, world_size: int = 1, threads: int | None = None,
            extra_env: dict[str, str] | None = None) -> measure.Run:
        """Run one contender; ``make_cmd(prefix, run_dir)`` builds its command. Prints a one-line summary."""
        prefix = self.out / "timelines" / name
        run_dir = self.out / "runs" / name
        if self.settings.quiet_wait > 0:
            measure.wait_until_quiet(self.settings.quiet_wait)
        env = {**contenders.env(threads or self.settings.threads), **(extra_env or {})}
        run = measure.run(name, make_cmd(prefix, run_dir), prefix, self.out / "logs" / f"{name}.log",
                          env, ROOT, world_size, self.settings.tty)
        self.runs.append(run)
        status = f"{run.wall_s:6.1f} s" if run.ok else f"FAILED ({run.error()})"
        print(f"  {name:<36} {status}   other processes: {run.other_load:.2f} cores", flush=True)
        return run

    def noise_note(self, runs: list[measure.Run]) -> str:
        """How busy the machine was with other processes during ``runs`` (the harness cannot control that)."""
        loads = [r.other_load for r in runs]
        return (f"Other processes used {min(loads):.2f}-{max(loads):.2f} cores during these runs (0 on an idle "
                "machine; the CPU time of every process of a contender's session, its own ranks and workers, "
                "is not counted as other load).")


def per_round(runs: list[measure.Run], fn) -> list:
    """``fn(run)`` for each round's run, ``None`` where the run failed."""
    return [fn(run) if run.ok else None for run in runs]


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def difference(a: float | None, b: float | None) -> float | None:
    return a - b if a is not None and b is not None else None


def same_round(a: list, b: list, fn=ratio) -> list:
    """``fn(a[r], b[r])`` per round: two contenders measured in the same round, one value per round."""
    return [fn(x, y) for x, y in zip(a, b, strict=True)]


def headline(values, spec: str = "{:.3f}", unit: str = "x") -> str:
    """A headline: the median of per-round values with their min-max range, e.g. ``0.981x (0.950-1.010x)``."""
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    mid = (spec + unit).format(statistics.median(values))
    if len(values) == 1:
        return f"{mid} (1 round)"
    sep = " to " if min(values) < 0 or "+" in spec else "-"
    return f"{mid} ({spec.format(min(values))}{sep}{(spec + unit).format(max(values))})"


def show(x: float | None, spec: str = "{:.3f}") -> str:
    """``spec.format(x)``, or ``-`` when there is no value."""
    return "-" if x is None else spec.format(x)


def median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def spread(values) -> str:
    """``median (min-max)`` of a list of numbers, compactly."""
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    mid = statistics.median(values)
    fmt = _fmt(mid)
    return fmt.format(mid) if len(values) == 1 else f"{fmt.format(mid)} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def _fmt(x: float) -> str:
    return "{:,.0f}" if abs(x) >= 100 else "{:.2f}" if abs(x) >= 1 else "{:.3f}"


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
