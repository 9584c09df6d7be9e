"""After a k-fold multirun (``hparams_search=kfold``): every fold's metric, their mean and spread, in ``cv.yaml``.

The folds of one cross-validation share a sweep dir for life, so re-running the command continues them. The
command that started them is kept there (``cv_command.yaml``); another one is refused before any fold runs,
as its folds would not compare. While a cross-validation runs, its dir is locked (``flock``): a second process
is refused in one line instead of racing the first for the same folds. The summary reads the ``result.yaml``
each job left (:class:`src.engine.utils.hydra_callbacks.SweepRecord`), so it works whatever ran the jobs (one process,
submitit).
The fold comes from each job's ``data.fold=`` override.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from src.engine.run.lock import try_lock
from src.engine.utils.errors import exit_with_error
from src.engine.utils.hydra_callbacks import RESULT_FILE

CV_FILE = "cv.yaml"  # in the sweep dir
COMMAND_FILE = "cv_command.yaml"  # in the sweep dir: the task overrides of the command that started it
CV_LOCK = ".cv.lock"  # in the sweep dir: held by the process running the cross-validation


def fold_of(overrides: list[str]) -> int | None:
    found = [o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0].lstrip("+~") == "data.fold"]
    return int(found[-1]) if found else None


def swept_folds(config: DictConfig) -> list[int]:
    """The ``data.fold`` values the multirun's jobs take: from the command line, else the sweeper's params."""
    params = config.hydra.sweeper.get("params") or {}
    given = [*(f"{key}={value}" for key, value in params.items()), *config.hydra.overrides.task]
    folds: list[int] = []
    for override in OverridesParser.create().parse_overrides(given):
        if override.key_or_group.lstrip("+~") == "data.fold":  # the command line's, parsed last, wins
            folds = list(override.sweep_iterator()) if override.is_sweep_override() else [override.value()]
    return folds


def same_command(started_with: list[str], command: list[str]) -> bool:
    """The same overrides, in any order where order cannot matter (each key given once)."""
    keys = [o.split("=", 1)[0] for o in command]
    return started_with == command or (sorted(started_with) == sorted(command) and len(set(keys)) == len(keys))


class CrossValidationSummary(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        n_folds = config.data.get("n_folds")
        outside = [f for f in swept_folds(config) if not (isinstance(f, int) and n_folds and 0 <= f < n_folds)]
        if outside:  # refused before any fold trains, not when the sweep reaches it
            exit_with_error(f"data.fold takes {', '.join(map(str, outside))}, outside the folds of data.n_folds="
                            f"{n_folds}; fix: sweep data.fold=range({n_folds}) (the default), or a subset of it")
        sweep_dir.mkdir(parents=True, exist_ok=True)
        self._lock = try_lock(sweep_dir / CV_LOCK)  # held until this process ends; the kernel then drops it
        if self._lock is None:
            exit_with_error(f"another process is running the cross-validation in {sweep_dir} (it holds {CV_LOCK}); "
                            "fix: wait for it to end, or give this one its own cv_name=<name>")
        command, kept = list(config.hydra.overrides.task), sweep_dir / COMMAND_FILE
        if not kept.is_file():
            OmegaConf.save(OmegaConf.create(command), kept)
            return
        started_with = list(OmegaConf.load(kept))
        if not same_command(started_with, command):
            exit_with_error(f"the cross-validation in {sweep_dir} was started with other overrides "
                            f"({' '.join(started_with)}); fix: run it with those to continue it, or give this one "
                            "its own cv_name=<name>")

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        results = [OmegaConf.to_container(OmegaConf.load(p)) for p in sweep_dir.glob(f"**/{RESULT_FILE}")]
        folds = {fold_of(r["overrides"]): r["value"] for r in results}
        folds.pop(None, None)
        values = [v for v in folds.values() if isinstance(v, int | float)]
        record = {"metric": config.get("optimized_metric"), "n_folds": config.data.get("n_folds"),
                  "folds": dict(sorted(folds.items())),
                  "mean": statistics.fmean(values) if values else None,
                  "std": statistics.stdev(values) if len(values) > 1 else None,  # sample standard deviation
                  "completed": len(values)}
        OmegaConf.save(OmegaConf.create(record), sweep_dir / CV_FILE)
        spread = f" ± {record['std']:.4g}" if record["std"] is not None else ""
        mean = f"{record['mean']:.6g}{spread}" if values else "none"
        print(f"[cv] {record['metric']} over {len(values)} of {record['n_folds']} folds: {mean}; saved to "
              f"{sweep_dir / CV_FILE}", flush=True)
