"""``<run dir>/status.yaml``: whether a run is running, finished, pruned, preempted, interrupted, failed or died, and
where it stopped.

``finished`` means the whole task is done (fit, then test when ``test=true``), and the file then holds
the run's metrics and the overrides it was started with: a relaunch of that command (a SLURM requeue,
the same job id) exits 0 saying so, instead of training again (:func:`completed_run`). While a run
works the file says ``running`` and names its owner (pid, host, start time); a run killed by SIGKILL
leaves ``running`` behind, which :func:`read_status` reports as ``died`` once that process is gone
from this host. Auto-resume (:mod:`src.engine.run.identity`) takes over runs that did not finish;
users and cluster scripts read the same file to see what happened to a run.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import math
import os
import socket
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from src.engine.run.layout import CHECKPOINT_DIR, LAST_CHECKPOINT  # noqa: F401 - also this module's names
from src.engine.runtime.launch_context import launch_context
from src.engine.utils.hooks import EndsRunAs

if TYPE_CHECKING:  # imported by the run-dir Hydra callback, before logging is set up: no Lightning at import
    import lightning as L
    from omegaconf import DictConfig

STATUS_FILE = "status.yaml"
PREDICTIONS_FILE = "predictions.csv"  # <run dir>/predictions.csv: src/predict.py's rows
RUNNING, FINISHED, PREEMPTED, FAILED, DIED = "running", "finished", "preempted", "failed", "died"
INTERRUPTED = "interrupted"  # Ctrl-C
PRUNED = "pruned"  # a search's trial that its pruner stopped early (src/engine/callbacks/optuna_pruning.py)
ENDED = (FINISHED, PRUNED)  # runs that ended as they should: nothing to resume


def holds_checkpoints(run_dir: str | os.PathLike) -> bool:
    """Whether ``run_dir`` holds checkpoints of a fit (files, or fsdp's folders)."""
    folder = Path(run_dir) / CHECKPOINT_DIR
    return folder.is_dir() and any(folder.glob("*.ckpt"))


def write_status(run_dir: str | os.PathLike, status: str, detail: str = "", **fields: Any) -> None:
    """Record ``status``, a one-line ``detail``, this process as owner, and ``fields`` (one JSON line each).

    Atomic (temp file, then rename). Call it from global rank 0.
    """
    path = Path(run_dir) / STATUS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{STATUS_FILE}.{os.getpid()}.tmp")
    when = dt.datetime.now().isoformat(timespec="seconds")
    me = psutil.Process()
    lines = [f"status: {status}", f"detail: {json.dumps(detail)}", f"time: '{when}'", f"pid: {me.pid}",
             f"host: {json.dumps(socket.gethostname())}", f"started: {me.create_time()!r}"]
    lines += [f"{key}: {json.dumps(value)}" for key, value in fields.items()]
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)


def read_fields(run_dir: str | os.PathLike) -> dict[str, Any]:
    """Every field of ``run_dir``'s status file (empty when it has none)."""
    path = Path(run_dir) / STATUS_FILE
    if not path.is_file():
        return {}
    import yaml

    with contextlib.suppress(yaml.YAMLError, OSError):
        fields = yaml.safe_load(path.read_text())
        return fields if isinstance(fields, dict) else {}
    return {}


def read_status(run_dir: str | os.PathLike) -> str | None:
    """The status of ``run_dir`` (None when it has none); ``running`` whose owner is gone from this host is ``died``."""
    fields = read_fields(run_dir)
    status = fields.get("status")
    if status == RUNNING and owner_gone(fields):
        return DIED
    return status


def owner_gone(fields: dict[str, Any]) -> bool:
    """True when the process that wrote ``fields`` ran on this host and is gone (its pid is free or reused)."""
    if fields.get("host") != socket.gethostname() or not isinstance(fields.get("pid"), int):
        return False  # another host's process (or an old file): this host cannot tell
    try:
        proc = psutil.Process(fields["pid"])
        started = fields.get("started")
        return proc.status() == psutil.STATUS_ZOMBIE or (
            isinstance(started, float) and abs(proc.create_time() - started) > 0.01)
    except psutil.Error:
        return True


def mark_if_died(run_dir: str | os.PathLike) -> bool:
    """Rewrite a ``running`` status whose owner is gone as ``died`` (naming that owner); True if it was."""
    fields = read_fields(run_dir)
    if fields.get("status") != RUNNING or not owner_gone(fields):
        return False
    detail = f"its process (pid {fields['pid']} on {fields['host']}) ended without a word: killed, e.g. by SIGKILL"
    with contextlib.suppress(OSError):
        write_status(run_dir, DIED, detail)
    return True


def completed_run(run_dir: str | os.PathLike, overrides: Sequence[str]) -> dict[str, float] | None:
    """The metrics recorded when ``run_dir`` ended its whole task (finished, or pruned by a search) with these
    ``overrides``, else None."""
    fields = read_fields(run_dir)
    if fields.get("status") not in ENDED or fields.get("overrides") != list(overrides):
        return None
    return dict(fields.get("metrics") or {})


def task_overrides() -> list[str]:
    """The command-line overrides of this Hydra job (what makes two launches the same command)."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def continues_own_run(cfg: DictConfig) -> bool:
    """Whether this training continues what its own run dir holds (``auto_resume``, no ``ckpt_path``): the one
    reading of ``auto_resume`` on the task's side; the directory itself is chosen by :mod:`src.engine.run.directory`."""
    return bool(cfg.get("train") and cfg.get("auto_resume") and not cfg.get("ckpt_path"))


def completed_task(cfg: DictConfig) -> dict[str, float] | None:
    """The recorded metrics when this run dir already finished this very command (a requeue or relaunch with
    ``auto_resume``; an explicit ``ckpt_path`` always trains), else None."""
    if not continues_own_run(cfg):
        return None
    return completed_run(cfg.paths.output_dir, task_overrides())


class RunStatus:
    """The task's handle on its status file: a stage note while it runs, and the metrics recorded at the end."""

    def __init__(self, trainer: L.Trainer, run_dir: str | os.PathLike) -> None:
        self.trainer, self.run_dir = trainer, run_dir
        self.metrics: dict[str, Any] = {}

    def note(self, detail: str) -> None:
        """Still ``running``, now at ``detail`` (e.g. "testing")."""
        if self.trainer.is_global_zero:
            write_status(self.run_dir, RUNNING, detail)


@contextlib.contextmanager
def run_status(trainer: L.Trainer, run_dir: str | os.PathLike, overrides: Sequence[str] = ()) -> Iterator[RunStatus]:
    """Around the whole task (fit, then test): ``running``, then ``finished`` with the task's metrics and
    ``overrides``, ``preempted`` (a stop signal), ``interrupted`` (Ctrl-C) or ``failed`` (any other error).

    A callback that ended the run early on purpose says how in its ``ended_run_as`` (status, detail).
    """
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from src.engine.checkpointing.last_checkpoint import run_position  # it builds on this module

    # torch: imported when a task runs
    from src.engine.runtime.exit_cleanup import before_a_failure_ends_this_rank, peer_failed

    # before fit the ranks are not known yet; a rank that torchrun or srun started beside this one may already have
    # failed and said why, and that record stays
    if launch_context().is_launching_process and not failed_on_another_rank(run_dir, since=psutil.Process().create_time()):
        write_status(run_dir, RUNNING)
    record = RunStatus(trainer, run_dir)

    def ended_for_a_failure(why: str) -> None:  # a peer died, froze or got stuck: this process ends at once
        if trainer.is_global_zero and not failed_on_another_rank(run_dir):
            write_status(run_dir, FAILED, f"{why} at {run_position(trainer)}")

    try:
        with before_a_failure_ends_this_rank(ended_for_a_failure):
            yield record
    except BaseException as err:
        preempted = isinstance(err, SIGTERMException) or getattr(err, "preempted", False)
        where = run_position(trainer)
        stage = "" if trainer.state.fn in (None, "fit") else f" during {trainer.state.fn.value}"
        # Lightning answers Ctrl-C with sys.exit(1) inside its KeyboardInterrupt handler
        interrupted = isinstance(err, KeyboardInterrupt) or isinstance(err.__context__, KeyboardInterrupt)
        lost_peer = peer_failed(err)
        if preempted:
            # Lightning's own stop (outside fit) carries no message: it saved nothing
            status, detail = PREEMPTED, f"{err} at {where}" if str(err) else f"SIGTERM{stage} at {where}, nothing saved"
        elif interrupted:
            status, detail = INTERRUPTED, f"Ctrl-C (KeyboardInterrupt){stage} at {where}"
        elif lost_peer:  # this rank only lost its connection: the failed rank records its own error
            status, detail = FAILED, f"another rank failed{stage} at {where} (its error is in the log)"
        else:
            status, detail = FAILED, f"{type(err).__name__}{stage} at {where}: {err}"
        if trainer.is_global_zero:
            if not (lost_peer and failed_on_another_rank(run_dir)):
                with contextlib.suppress(OSError):  # a full disk must not hide the error that stopped the run
                    write_status(run_dir, status, detail)
        elif status == FAILED and not lost_peer and not getattr(trainer.strategy, "outlives_a_failed_rank", False):
            # the cause, from the rank that failed (under ps the job goes on without a failed worker)
            with contextlib.suppress(OSError):
                write_status(run_dir, status, f"rank {trainer.global_rank}: {detail}", rank=trainer.global_rank)
        raise
    if trainer.is_global_zero:
        ended = next((c.ended_run_as for c in trainer.callbacks if isinstance(c, EndsRunAs) and c.ended_run_as), None)
        write_status(run_dir, *(ended or (FINISHED, run_position(trainer))), overrides=list(overrides),
                     metrics=plain_metrics(record.metrics))


def failed_on_another_rank(run_dir: str | os.PathLike, since: float | None = None) -> bool:
    """A rank other than global rank 0 has recorded its own failure in this attempt (rank 0 set ``running`` at
    its start, unless that record was there already): rank 0, which only lost its connection to it, keeps that
    cause. ``since`` (seconds since the epoch): only a record written at or after it counts."""
    fields = read_fields(run_dir)
    if fields.get("status") != FAILED or fields.get("rank", 0) == 0:
        return False
    if since is None:
        return True
    try:
        return dt.datetime.fromisoformat(str(fields.get("time"))).timestamp() >= math.floor(since)
    except ValueError:
        return False


def plain_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """Scalar metrics as plain floats (tensors and NaN/inf left out), for status.yaml."""
    plain = {}
    for key, value in metrics.items():
        with contextlib.suppress(TypeError, ValueError, RuntimeError):
            number = float(value.item() if hasattr(value, "item") else value)
            if math.isfinite(number):
                plain[str(key)] = number
    return plain
