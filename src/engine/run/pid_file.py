"""PID files: which processes are this project's ranks, for ``make kill-orphans`` (a Hydra callback)."""

from __future__ import annotations

import atexit
import json
import os
from pathlib import Path
from typing import Any

import psutil
from hydra.core.utils import JobReturn
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from src.engine.runtime.launch_context import CHILD, TORCHRUN, launch_context


class PidFile(Callback):
    """While a job runs, register this process in ``<dirpath>/<pid>.json``; remove the file when the job ends.

    A rank started by a launcher (Lightning's child ranks, torchrun; they all get ``LOCAL_RANK``) also records
    its launcher, the parent process. When that launcher is gone, the rank is an orphan: ``make kill-orphans``
    ends it by PID, checking the start time so a reused PID is never hit.
    """

    def __init__(self, dirpath: str) -> None:
        self.path = Path(dirpath) / f"{os.getpid()}.json"
        # A job that ends in SystemExit (a refused run: one error line, exit 2) skips Hydra's on_job_end
        atexit.register(self.path.unlink, missing_ok=True)

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
