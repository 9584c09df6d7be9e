"""Lightning callback: check (and optionally measure) the communication under a training run.

It runs on the trainer's own default process group once the strategy has created it (ddp, ddp_spawn and
DDPStrategy subclasses such as the pipeline strategy), needs nothing from the LightningModule, and stops
the run with :class:`~src.engine.collectives.runtime.CollectiveError` (wrong result) or
:class:`~src.engine.collectives.runtime.CollectiveTimeoutError` (a collective hung) whose message
names the operation, the ranks and expected vs received values.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from src.engine.collectives.benchmark import (
    DEFAULT_OPS,
    BenchRow,
    benchmark_sweep,
    busbw_factor,
    format_size,
    parse_size,
)
from src.engine.collectives.checks import Check, CheckReport
from src.engine.collectives.report import write_json
from src.engine.collectives.runtime import CollectiveError, is_distributed
from src.engine.collectives.suite import run_suite
from src.engine.utils.errors import ConfigError

TRIGGERS = ("setup", "fit_start")


def _as_list(value: Any) -> list:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return list(value)


class CollectivesCheck(Callback):
    """Run the collective correctness suite (and a small benchmark) on the training process group.

    Args:
        at: ``"setup"``, ``"fit_start"``, both (a list), or None/[] for neither.
        every_n_epochs: also run after every N-th training epoch (0 = never).
        timeout_s: per-operation timeout; a collective that takes longer stops the run.
        ops: restrict the checks to these collectives or check names (None = all).
        benchmark: also time ``bench_ops`` at ``bench_sizes`` and log their bandwidth.
        filename: JSON written by global rank 0 into ``trainer.log_dir`` (or ``default_root_dir``).
        extra_checks: additional :class:`~src.engine.collectives.checks.Check` objects (e.g. your own).
    """

    def __init__(
        self,
        at: str | Sequence[str] | None = "fit_start",
        every_n_epochs: int = 0,
        timeout_s: float = 60.0,
        ops: Sequence[str] | None = None,
        benchmark: bool = False,
        bench_sizes: Sequence[int | str] = ("64KB", "1MB"),
        bench_ops: Sequence[str] = DEFAULT_OPS,
        bench_warmup: int = 2,
        bench_iters: int = 5,
        filename: str = "collectives.json",
        extra_checks: Sequence[Check] = (),
    ) -> None:
        self.at = [str(a) for a in _as_list(at)]
        unknown = [a for a in self.at if a not in TRIGGERS]
        if unknown:
            raise ConfigError(f"CollectivesCheck(at={unknown}) is not a trigger; fix: use one or both of {list(TRIGGERS)}")
        if every_n_epochs < 0 or timeout_s <= 0:
            raise ConfigError("CollectivesCheck needs every_n_epochs >= 0 and timeout_s > 0; fix: set them so")
        self.every_n_epochs = int(every_n_epochs)
        self.timeout_s = float(timeout_s)
        self.ops = [str(o) for o in _as_list(ops)] or None
        self.benchmark = bool(benchmark)
        self.bench_sizes = [s if isinstance(s, int) else str(s) for s in _as_list(bench_sizes)]
        self.bench_ops = [str(o) for o in _as_list(bench_ops)]
        try:  # fail at construction, not in the middle of training
            for size in self.bench_sizes:
                parse_size(size)
            for op in self.bench_ops:
                busbw_factor(op, 2)
        except ValueError as err:
            raise ConfigError(f"CollectivesCheck(bench_sizes/bench_ops): {err}; fix: give sizes in bytes and ops the bench knows") from None
        self.bench_warmup, self.bench_iters = int(bench_warmup), int(bench_iters)
        self.filename = filename
        self.extra_checks = list(extra_checks)
        self.records: list[dict[str, Any]] = []
        self._told_nothing_to_do = False

    # ------------------------------------------------------------------ Lightning hooks
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if "setup" in self.at:
            self.run(trainer, f"setup:{getattr(stage, 'value', stage)}")

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if "fit_start" in self.at:
            self.run(trainer, "fit_start")

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.every_n_epochs and (trainer.current_epoch + 1) % self.every_n_epochs == 0:
            self.run(trainer, f"epoch_end:{trainer.current_epoch}")

    # ------------------------------------------------------------------ work
    def run(self, trainer: L.Trainer, trigger: str) -> dict[str, Any] | None:
        """Check (and measure) now; log, save, and raise on a wrong result. Returns the record, or None
        when there is no process group to check."""
        if not is_distributed() or trainer.world_size < 2:
            if not self._told_nothing_to_do:
                rank_zero_info("CollectivesCheck: single process, no process group - nothing to check")
                self._told_nothing_to_do = True
            return None
        path = self.output_path(trainer)  # before any check: a timed-out group can no longer broadcast it
        record: dict[str, Any] = {"trigger": trigger, "epoch": trainer.current_epoch,
                                  "global_step": trainer.global_step, "time": time.time()}
        report: CheckReport | None = None
        try:
            report = run_suite(only=self.ops, extra_checks=self.extra_checks, timeout_s=self.timeout_s)
            record["checks"] = report.to_dict()
            self._summary(trigger, report)
            report.raise_if_failed()
            rows: list[BenchRow] = []
            if self.benchmark:
                rows, skipped = benchmark_sweep(self.bench_sizes, self.bench_ops, self.bench_warmup,
                                                self.bench_iters)
                record["benchmark"] = {"rows": [r.as_dict() for r in rows], "skipped": skipped}
            record["metrics"] = self._metrics(report, rows)
        except CollectiveError as err:  # wrong result or timeout: record it, then stop the run
            record["error"] = str(err)
            if report is not None:
                record["metrics"] = self._metrics(report, [])
                self._log(trainer, record["metrics"])
            self._save(trainer, record, path)
            raise
        self._log(trainer, record["metrics"])
        self._save(trainer, record, path)
        return record

    @staticmethod
    def _summary(trigger: str, report: CheckReport) -> None:
        counts = report.counts()
        rank_zero_info(f"CollectivesCheck[{trigger}]: {counts['passed']} passed, {counts['failed']} failed, "
                       f"{counts['skipped']} skipped in {report.seconds:.2f}s "
                       f"({report.backend}, {report.world_size} ranks)")

    @staticmethod
    def _metrics(report: CheckReport, rows: Sequence[BenchRow]) -> dict[str, float]:
        """Slash-namespaced scalars: check counts, then per-op bandwidth (largest size also without size)."""
        metrics = {f"comm/check/{k}": float(v) for k, v in report.counts().items()}
        metrics["comm/check/seconds"] = report.seconds
        largest = max((r.size_bytes for r in rows), default=None)
        for r in rows:
            for key, value in (("busbw_GBps", r.busbw_GBps), ("algbw_GBps", r.algbw_GBps),
                               ("latency_us", r.latency_us)):
                metrics[f"comm/{r.op}/{format_size(r.size_bytes)}/{key}"] = value
                if r.size_bytes == largest:
                    metrics[f"comm/{r.op}/{key}"] = value
        return metrics

    @staticmethod
    def _log(trainer: L.Trainer, metrics: dict[str, float]) -> None:
        for logger in trainer.loggers:  # Lightning's loggers write on global rank 0 only
            logger.log_metrics(metrics, step=trainer.global_step)
            logger.save()

    def _save(self, trainer: L.Trainer, record: dict[str, Any], path: Path) -> None:
        self.records.append(record)
        if trainer.is_global_zero:
            write_json(path, {"runs": self.records})

    def output_path(self, trainer: L.Trainer) -> Path:
        """Where the JSON goes: the first logger's directory, else the trainer's root directory.

        Call it on every rank: ``trainer.log_dir`` broadcasts rank 0's directory.
        """
        return Path(trainer.log_dir or trainer.default_root_dir) / self.filename
