"""Hydra callbacks: output-dir check, a record of every sweep's best job, and PID files of running ranks."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import psutil
from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from src.runtime.launch_context import CHILD, TORCHRUN, launch_context
from src.utils.checkpoint import check_no_earlier_checkpoints
from src.utils.errors import ConfigError
from src.utils.resolvers import rank_zero_value
from src.utils.run_identity import forget_run_dir
from src.utils.run_status import PRUNED, read_status


def unwritable_reason(directory: Path) -> str | None:
    """Why ``directory`` cannot be created or written, or None when it can."""
    probe = directory.absolute()
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is a file, not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable"
    return None


class OutputDirCheck(Callback):
    """Stop with one line, before Hydra writes anything, when the run or sweep directory cannot be created or
    holds checkpoints of an earlier run this one would not resume from.

    Other ranks of the launch (torchrun, srun) exit 2 quietly: global rank 0 says why.
    """

    def _check(self, directory: str, config: DictConfig | None = None) -> None:
        reason = unwritable_reason(Path(directory))
        message = (f"cannot create output dir {directory}: {reason}; fix: choose another with hydra.run.dir=... "
                   "(or paths.log_dir=...)") if reason else None
        if message is None and config is not None:
            try:
                check_no_earlier_checkpoints(config, directory)
            except ConfigError as err:
                message = str(err)
        if message:
            if rank_zero_value("0") is not None:
                print(f"error: {message}", file=sys.stderr, flush=True)
            raise SystemExit(2)

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check(config.hydra.run.dir, config)

    def on_run_end(self, config: DictConfig, **kwargs: Any) -> None:
        forget_run_dir()  # release the run dir's lock (a later in-process run chooses anew)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check(config.hydra.sweep.dir)


# -- multirun: every job's metric, and the best job ------------------------------------------------------
RESULT_FILE = "result.yaml"  # in each job's dir
BEST_FILE = "best.yaml"  # in the sweep dir


class SweepRecord(Callback):
    """Record each multirun job's returned metric; at the end, print the best job and save it to ``best.yaml``.

    Each job writes ``result.yaml`` (overrides, metric) into its own dir, from global rank 0 only, so the
    record also works when jobs run in other processes (submitit) and for any sweeper (grid, Optuna). A job
    whose run was pruned (``status.yaml``) is recorded as ``PRUNED`` with no value: it never counts as best.
    """

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if config.hydra.mode != RunMode.MULTIRUN or rank_zero_value("0") is None:
            return  # a plain run, or a non-zero rank of a job (srun tasks, child ranks)
        output_dir = Path(config.hydra.runtime.output_dir)
        pruned = read_status(output_dir) == PRUNED
        completed = job_return.status == JobStatus.COMPLETED and not pruned
        result = {"job": int(config.hydra.job.num), "overrides": list(job_return.overrides or []),
                  "dir": str(output_dir), "status": "PRUNED" if pruned else job_return.status.name,
                  "value": job_return.return_value if completed else None}
        OmegaConf.save(OmegaConf.create(result), output_dir / RESULT_FILE)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if config.hydra.sweeper.get("worker") is not None:
            return  # a worker process of a parallel search: the process that started the workers sums up
        sweep_dir = Path(config.hydra.sweep.dir)
        results = sorted((OmegaConf.to_container(OmegaConf.load(p)) for p in sweep_dir.glob(f"**/{RESULT_FILE}")),
                         key=lambda r: r["job"])
        best = best_result(results, config.get("optimized_mode", "max"))
        if best is None:
            print(f"[sweep] no job returned a metric; results in {sweep_dir}", flush=True)
            return
        swept = [o for o in best["overrides"] if not all(o in r["overrides"] for r in results)]
        record = {"metric": config.get("optimized_metric"), "mode": config.get("optimized_mode", "max"), **best,
                  "swept": swept, "jobs": len(results),
                  "completed": sum(r["status"] == "COMPLETED" for r in results),
                  "pruned": sum(r["status"] == "PRUNED" for r in results)}
        OmegaConf.save(OmegaConf.create(record), sweep_dir / BEST_FILE)
        print(f"[sweep] best of {len(results)} jobs: job {best['job']}, {record['metric']}={best['value']:.6g} "
              f"({record['mode']}) with {' '.join(swept or best['overrides'])}; saved to {sweep_dir / BEST_FILE}",
              flush=True)


def best_result(results: list[dict], mode: str) -> dict | None:
    """The result with the best numeric ``value`` (``mode`` max or min; the earliest job wins a tie)."""
    scored = [r for r in results if isinstance(r.get("value"), int | float) and not math.isnan(r["value"])]
    if not scored:
        return None
    return (max if mode == "max" else min)(scored, key=lambda r: r["value"])


# -- PID files: which processes are this project's ranks, for `make kill-orphans` -------------------------
class PidFile(Callback):
    """While a job runs, register this process in ``<dirpath>/<pid>.json``; remove the file when the job ends.

    A rank started by a launcher (Lightning's child ranks, torchrun; they all get ``LOCAL_RANK``) also records
    its launcher, the parent process. When that launcher is gone, the rank is an orphan: ``make kill-orphans``
    ends it by PID, checking the start time so a reused PID is never hit.
    """

    def __init__(self, dirpath: str) -> None:
        self.path = Path(dirpath) / f"{os.getpid()}.json"

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        me = psutil.Process()
        launcher = me.parent() if launch_context().launcher in (CHILD, TORCHRUN) else None
        record = {"pid": me.pid, "started": me.create_time(), "cmdline": me.cmdline(),
                  "run_dir": str(config.hydra.runtime.output_dir),
                  "launcher": None if launcher is None else {"pid": launcher.pid, "started": launcher.create_time()}}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(record))

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        self.path.unlink(missing_ok=True)


def running(pid: int, started: float) -> psutil.Process | None:
    """The live process ``pid`` if it is the one that started at ``started`` (not a reused PID), else None."""
    try:
        proc = psutil.Process(pid)
        return proc if abs(proc.create_time() - started) < 0.01 and proc.status() != psutil.STATUS_ZOMBIE else None
    except psutil.Error:
        return None


def registered_ranks(pid_dir: Path) -> list[tuple[dict, psutil.Process, bool]]:
    """``(record, process, orphaned)`` for each live registered process; files of ended processes are removed."""
    ranks = []
    for path in sorted(pid_dir.glob("*.json")):
        record = json.loads(path.read_text())
        proc = running(record["pid"], record["started"])
        if proc is None:
            path.unlink(missing_ok=True)
            continue
        launcher = record["launcher"]
        orphaned = launcher is not None and running(launcher["pid"], launcher["started"]) is None
        ranks.append(({**record, "file": str(path)}, proc, orphaned))
    return ranks
