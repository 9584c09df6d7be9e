"""Hydra callback of multiruns: each job's metric, and a record of the sweep's best job."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from src.engine.run.status import PRUNED, read_status
from src.engine.utils.resolvers import rank_zero_value

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
        folds, unit = config.hydra.sweeper.get("cv_folds"), "job"
        if folds:  # an Optuna search on the cross-validated mean: its trials compete, not their folds
            results, unit = trials_of_folds(results, folds), "trial"
        best = best_result(results, config.get("optimized_mode", "max"))
        if best is None:
            print(f"[sweep] no {unit} returned a metric; results in {sweep_dir}", flush=True)
            return
        swept = [o for o in best["overrides"] if not all(o in r["overrides"] for r in results)]
        record = {"metric": config.get("optimized_metric"), "mode": config.get("optimized_mode", "max"), **best,
                  "swept": swept, f"{unit}s": len(results),
                  "completed": sum(r["status"] == "COMPLETED" for r in results),
                  "pruned": sum(r["status"] == "PRUNED" for r in results)}
        OmegaConf.save(OmegaConf.create(record), sweep_dir / BEST_FILE)
        print(f"[sweep] best of {len(results)} {unit}s: {unit} {best['job']}, {record['metric']}={best['value']:.6g} "
              f"({record['mode']}) with {' '.join(swept or best['overrides'])}; saved to {sweep_dir / BEST_FILE}",
              flush=True)


def trials_of_folds(results: list[dict], folds: int) -> list[dict]:
    """The results of a search's fold jobs (job ``n*K + i``: fold ``i`` of trial ``n``), one per trial: its
    value is the mean over its K folds, when all K completed."""
    trials: dict[int, list[dict]] = {}
    for result in results:
        trials.setdefault(result["job"] // folds, []).append(result)
    merged = []
    for number, jobs in sorted(trials.items()):
        values = [j["value"] for j in jobs if j["status"] == "COMPLETED"]
        complete = len(values) == folds and all(isinstance(v, int | float) for v in values)
        status = "COMPLETED" if complete else next((j["status"] for j in jobs if j["status"] != "COMPLETED"), "RUNNING")
        own = [o for o in jobs[0]["overrides"] if o.split("=", 1)[0] not in ("data.n_folds", "data.fold")]
        merged.append({"job": number, "overrides": own, "dir": jobs[0]["dir"], "status": status,
                       "value": statistics.fmean(values) if complete else None, "folds": values})
    return merged


def best_result(results: list[dict], mode: str) -> dict | None:
    """The result with the best numeric ``value`` (``mode`` max or min; the earliest job wins a tie)."""
    scored = [r for r in results if isinstance(r.get("value"), int | float) and not math.isnan(r["value"])]
    if not scored:
        return None
    return (max if mode == "max" else min)(scored, key=lambda r: r["value"])
