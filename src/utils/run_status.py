"""``<run dir>/status.yaml``: whether a run is running, finished, preempted or failed, and where it stopped.

Auto-resume (:mod:`src.utils.run_identity`) takes over only runs that did not finish; users and
cluster scripts read the same file to see what happened to a run.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from src.runtime.launch_context import launch_context

if TYPE_CHECKING:  # imported by the run-dir resolver, before logging is set up: no Lightning at import
    import lightning as L

STATUS_FILE = "status.yaml"
RUNNING, FINISHED, PREEMPTED, FAILED = "running", "finished", "preempted", "failed"


def write_status(run_dir: str | os.PathLike, status: str, detail: str = "") -> None:
    """Record ``status`` (and a one-line ``detail``) for ``run_dir``, atomically. Call it from global rank 0."""
    path = Path(run_dir) / STATUS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{STATUS_FILE}.{os.getpid()}.tmp")
    when = dt.datetime.now().isoformat(timespec="seconds")
    tmp.write_text(f"status: {status}\ndetail: {json.dumps(detail)}\ntime: '{when}'\npid: {os.getpid()}\n")
    os.replace(tmp, path)


def read_status(run_dir: str | os.PathLike) -> str | None:
    """The recorded status of ``run_dir``, or None when it has none."""
    path = Path(run_dir) / STATUS_FILE
    if not path.is_file():
        return None
    for line in path.read_text().splitlines():
        if line.startswith("status:"):
            return line.split(":", 1)[1].strip()
    return None


@contextlib.contextmanager
def run_status(trainer: L.Trainer, run_dir: str | os.PathLike) -> Iterator[None]:
    """Around ``fit``: ``running``, then ``finished``, ``preempted`` (a stop signal) or ``failed`` (any error)."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    if launch_context().is_launching_process:  # before fit the ranks are not known yet
        write_status(run_dir, RUNNING)
    try:
        yield
    except BaseException as err:
        if trainer.is_global_zero:
            preempted = isinstance(err, SIGTERMException) or getattr(err, "preempted", False)
            where = f"epoch {trainer.current_epoch}, global step {trainer.global_step}"
            detail = f"{err} at {where}" if preempted else f"{type(err).__name__} at {where}: {err}"
            with contextlib.suppress(OSError):  # a full disk must not hide the error that stopped the run
                write_status(run_dir, PREEMPTED if preempted else FAILED, detail)
        raise
    if trainer.is_global_zero:
        write_status(run_dir, FINISHED, f"epoch {trainer.current_epoch}, global step {trainer.global_step}")
