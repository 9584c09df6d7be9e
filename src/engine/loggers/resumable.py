"""Loggers that keep one run one series across resumes: a killed run re-run with the same command continues its
logs instead of starting new ones.

A resume replays the steps between its checkpoint and the kill, so every logger gets those steps twice.
Lightning's loggers start a new series on each start instead: CSV and TensorBoard pick the next
``version_N`` (and CSV deletes ``metrics.csv`` if told to reuse a version), W&B makes a new run unless it
is given the same id, and MLflow a new run unless it is given the run id. Here:

* :class:`ResumableCSVLogger` keeps ``version_0``. The first metrics a fit logs are the first it replays
  (:class:`src.engine.checkpointing.continue_logs.ContinueLogs` tells the loggers when a fit starts), so the rows of
  that step and after are dropped from the file before the new ones are written (CSVLogger has no such
  option). Rows are written as they are logged, so a kill loses none of the steps the checkpoint holds.
  Every rewrite of the file is atomic: CSVLogger rewrites it in place when a new column appears, and a kill
  during that rewrite emptied it; here the new header is written first, to a temp file swapped in whole.
* :class:`ResumableTensorBoardLogger` keeps ``version_0`` and, at the first metrics a fit logs, writes
  TensorBoard's own restart marker (the ``SessionLog.START`` event that ``SummaryWriter(purge_step=)``
  writes): TensorBoard then hides the earlier events of that step and after.
* :class:`ResumableMLFlowLogger` tags its run with the run's id (:func:`src.engine.run.identity.ensure_run_uid`)
  and continues the run of that tag, if an earlier attempt made one. It asks the tracking store what it
  holds of each metric (:class:`HeldPoints`), and does not send a replayed point again (MLflow has no way to
  replace one: it would keep both).
* W&B is Lightning's own WandbLogger, given the run's id and ``resume: allow`` (``configs/logger/wandb.yaml``):
  every attempt logs into one W&B run, and W&B's own resume handles the replayed steps (online, W&B keeps
  one point per step of a run; offline, each attempt's points stay in its own folder until ``wandb sync``).
"""

from __future__ import annotations

import csv
import os
import warnings
from argparse import Namespace
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only

from src.engine.runtime.launch_context import launch_context

RUN_TAG = "lightning_hydra_template.run_id"  # MLflow tag holding the run's id


class ResumableCSVLogger(CSVLogger):
    """Lightning's CSVLogger writing every row as it is logged into one ``metrics.csv`` that a resume continues."""

    def __init__(self, save_dir: str, name: str = "csv", version: int | str = 0, prefix: str = "",
                 flush_logs_every_n_steps: int = 1) -> None:
        super().__init__(save_dir, name=name, version=version, prefix=prefix,
                         flush_logs_every_n_steps=flush_logs_every_n_steps)
        self._writer: Any = None
        self._replays = False  # the next metrics logged start a fit's replay
        self._key_prefix = f"{prefix}{self.LOGGER_JOIN_CHAR}" if prefix else ""

    @property
    def metrics_file(self) -> Path:
        return Path(self.log_dir) / "metrics.csv"

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        if self._writer is None:
            kept = self.metrics_file.with_name(".metrics.csv.kept")
            if self.metrics_file.is_file():  # Lightning's writer deletes the file it finds: keep it aside
                os.replace(self.metrics_file, kept)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "Experiment logs directory .* exists and is not empty")
                self._writer = super().experiment
            if kept.is_file():
                os.replace(kept, self.metrics_file)
                self._writer.metrics_keys = _header(self.metrics_file)
        return self._writer

    def replay_starts(self, starts: bool = True) -> None:
        """A fit starts (True) or ended (False): the next metrics it logs replace the rows of their step and after."""
        self._replays = starts

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        if self._replays and step is not None:
            _drop_rows_from(self.experiment, self.metrics_file, step)
        self._replays = False
        # columns this save would add: widen the header here, atomically, so CSVLogger only appends
        keys = {self._key_prefix + k for k in metrics} | {"step"} | set().union(*self.experiment.metrics)
        _widen_header(self.experiment, self.metrics_file, keys)
        super().log_metrics(metrics, step)


def _header(path: Path) -> list[str]:
    with open(path, newline="") as f:
        return next(csv.reader(f), [])


def _read_rows(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
        return list(reader.fieldnames or []), rows


def _write_rows(writer: Any, path: Path, fields: list[str], rows: list[dict[str, str]]) -> None:
    """Replace ``path`` with ``fields`` and ``rows`` atomically (a kill leaves the old or the new file)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", newline="") as f:
        out = csv.DictWriter(f, fieldnames=fields)
        out.writeheader()
        out.writerows(rows)
    os.replace(tmp, path)
    writer.metrics_keys = fields


def _drop_rows_from(writer: Any, path: Path, step: int) -> None:
    """Rewrite ``path`` without its rows of ``step`` and after."""
    if not path.is_file():
        return
    fields, rows = _read_rows(path)
    kept = [row for row in rows if not row.get("step") or int(float(row["step"])) < step]
    if len(kept) < len(rows):
        _write_rows(writer, path, fields, kept)


def _widen_header(writer: Any, path: Path, keys: set[str]) -> None:
    """Add the columns ``keys`` that ``path`` lacks (sorted, as CSVLogger orders them), keeping every row."""
    new = keys - set(writer.metrics_keys)
    if not new:
        return
    fields = sorted([*writer.metrics_keys, *new])
    if path.is_file():
        _write_rows(writer, path, fields, _read_rows(path)[1])
    else:
        writer.metrics_keys = fields


class ResumableTensorBoardLogger(TensorBoardLogger):
    """Lightning's TensorBoardLogger in ``version_0``, which a resume continues; TensorBoard shows the replayed
    steps once."""

    def __init__(self, save_dir: str, name: str | None = None, version: int | str = 0, **kwargs: Any) -> None:
        super().__init__(save_dir, name=name, version=version, **kwargs)
        self._continues = any(Path(self.log_dir).glob("events.out.tfevents.*"))  # before this process writes one
        self._replays = False

    @rank_zero_only
    def log_hyperparams(self, params: dict[str, Any] | Namespace, metrics: dict[str, Any] | None = None,
                        step: int | None = None) -> None:
        if self._continues:  # the first attempt wrote them (same command); again would repeat hp_metric at step 0
            self.hparams.update(params if isinstance(params, dict) else vars(params))
            return
        replays, self._replays = self._replays, False  # hp_metric's step 0 is not where a replay starts
        super().log_hyperparams(params, metrics, step)
        self._replays = replays

    def replay_starts(self, starts: bool = True) -> None:
        """A fit starts (True) or ended (False): TensorBoard hides the earlier events from the next metrics' step."""
        self._replays = starts

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        if self._replays and self._continues and step is not None:
            from tensorboard.compat.proto.event_pb2 import Event, SessionLog

            self.experiment.file_writer.add_event(Event(step=step, session_log=SessionLog(status=SessionLog.START)))
        self._replays = False
        super().log_metrics(metrics, step)


class ResumableMLFlowLogger(MLFlowLogger):
    """Lightning's MLFlowLogger continuing the MLflow run tagged ``run_uid``: a resume logs into the same run."""

    def __init__(self, experiment_name: str = "lightning_logs", run_uid: str | None = None,
                 tags: dict[str, Any] | None = None, run_id: str | None = None, **kwargs: Any) -> None:
        tags = {**(tags or {}), **({RUN_TAG: run_uid} if run_uid else {})}
        self._held = HeldPoints()
        self._key_prefix = f"{kwargs['prefix']}{self.LOGGER_JOIN_CHAR}" if kwargs.get("prefix") else ""
        if run_id is None and run_uid and launch_context().is_launching_process:  # only rank 0 logs
            # MLFlowLogger's own default: MLFLOW_TRACKING_URI, else a file store under save_dir
            uri = kwargs.get("tracking_uri", os.getenv("MLFLOW_TRACKING_URI")) or f"file:{kwargs.get('save_dir', './mlruns')}"
            run_id = earlier_mlflow_run(uri, experiment_name, run_uid)
            if run_id is not None:
                self._held = mlflow_points_held(uri, run_id)
        super().__init__(experiment_name=experiment_name, tags=tags, run_id=run_id, **kwargs)

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Only the points the run does not hold yet: a resume replays steps MLflow holds, and it would keep both."""
        metrics = self._held.unsent(metrics, step, self._key_prefix)
        if metrics:
            super().log_metrics(metrics, step)


class HeldPoints:
    """What a logger's run holds of each metric: its last step, and how many points it has at that step (a
    metric can be logged more than once at one step, e.g. ``epoch`` by the training and the validation epoch end).

    A logger holds a prefix of each metric's points, and a resume replays them in the same order, so a replayed
    point is held if its step is earlier than that last step, or it is one of the first ``count`` at that step.
    """

    def __init__(self) -> None:
        self._last: dict[str, tuple[int, int]] = {}  # metric -> (last step held, points held at that step)

    def add(self, metrics: Iterable[str], step: int) -> None:
        """The run holds a point of each of ``metrics`` at ``step`` (points added in the order they were logged)."""
        for key in metrics:
            last, count = self._last.get(key, (-1, 0))
            self._last[key] = (step, count + 1 if step == last else 1)

    def unsent(self, metrics: Mapping[str, float], step: int | None, key_prefix: str = "") -> dict[str, float]:
        """The points of ``metrics`` at ``step`` the run does not hold yet; each held one is counted off."""
        if not self._last or step is None:
            return dict(metrics)
        out = {}
        for name, value in metrics.items():
            key = key_prefix + name
            last, count = self._last.get(key, (-1, 0))
            if step > last:
                out[name] = value
                self._last.pop(key, None)  # past what the run holds: every later point is new
            elif step == last:
                if count:
                    self._last[key] = (last, count - 1)
                else:
                    out[name] = value
        return out


def earlier_mlflow_run(tracking_uri: str, experiment_name: str, run_uid: str) -> str | None:
    """The id of the run of ``experiment_name`` tagged ``run_uid`` (an earlier attempt of this run), if any."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    experiment = client.get_experiment_by_name(experiment_name)
    if experiment is None:
        return None
    runs = client.search_runs([experiment.experiment_id], f"tags.`{RUN_TAG}` = '{run_uid}'", max_results=1)
    return runs[0].info.run_id if runs else None


def mlflow_points_held(tracking_uri: str, run_id: str) -> HeldPoints:
    """What MLflow run ``run_id`` holds of each metric."""
    from mlflow.tracking import MlflowClient

    client, held = MlflowClient(tracking_uri), HeldPoints()
    for key in client.get_run(run_id).data.metrics:
        for metric in sorted(client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp)):
            held.add([key], metric.step)
    return held


def ResumableWandbLogger(**kwargs: Any) -> Any:  # noqa: N802 - the removed class's name, kept for one release
    """Removed (docs/migration.md): W&B's own resume replaced it. Lightning's WandbLogger, with a
    warning naming the config to change."""
    from lightning.pytorch.loggers import WandbLogger

    warnings.warn("src.engine.loggers.resumable.ResumableWandbLogger is removed (docs/migration.md); fix: set the logger's "
                  "_target_ to lightning.pytorch.loggers.wandb.WandbLogger, as configs/logger/wandb.yaml does",
                  DeprecationWarning, stacklevel=2)
    return WandbLogger(**kwargs)
