"""The composed config and the parameter counts reach every logger's files, once, from rank 0 (issue 13)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from lightning import Trainer
from torch import nn

from src.engine.utils.job_setup import LoadDotenv
from src.engine.utils.logging_utils import HyperparameterLogger, log_hyperparameters
from tests.helpers.entry import run_entry

LR = 0.0123  # distinctive, so finding it proves it came from this run's config
MLP_PARAMS = 28 * 28 * 512 + 512 + 512 * 256 + 256 + 256 * 10 + 10  # default MLP: 784-512-256-10
TINY = ["trainer.accelerator=cpu", "trainer.max_epochs=1", "+trainer.limit_train_batches=2", "+trainer.limit_val_batches=2",
        "+trainer.limit_test_batches=2", "extras.print_config=false", f"model.optimizer.lr={LR}"]


def _train(tmp_path: Path, *overrides: str) -> Path:
    run_dir = tmp_path / "run"
    proc = run_entry("train", *TINY, f"paths.log_dir={tmp_path}", f"hydra.run.dir={run_dir}", *overrides,
                     f"logger.mlflow.tracking_uri=file:{tmp_path}/mlflow/mlruns",  # not a server from .env
                     env={"WANDB_SILENT": "true"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def _mlflow_params(tmp_path: Path) -> list[dict[str, str]]:
    """Each MLflow run's params (file store: one file per param, the key's slashes as folders)."""
    runs = [p.parent for p in (tmp_path / "mlflow" / "mlruns").glob("*/*/params")]
    return [{str(f.relative_to(r / "params")): f.read_text() for f in (r / "params").rglob("*") if f.is_file()}
            for r in runs]


def _tensorboard_hparams(event_dir: Path) -> dict[str, object]:
    """The hparams TensorBoard's HPARAMS tab shows: the session-start record in the event files."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.plugins.hparams import plugin_data_pb2

    found: dict[str, object] = {}
    for path in event_dir.glob("events.out.tfevents.*"):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name == "hparams":
                    data = plugin_data_pb2.HParamsPluginData.FromString(value.metadata.plugin_data.content)
                    for key, hp in data.session_start_info.hparams.items():
                        found[key] = getattr(hp, hp.WhichOneof("kind"))
    return found


def _wandb_config(run_file: Path) -> dict[str, object]:
    """The config records of an offline W&B run file."""
    from tests.helpers.wandb_records import item_key, records

    return {item_key(item): json.loads(item.value_json)
            for record in records(run_file) if record.WhichOneof("record_type") == "config"
            for item in record.config.update}


@pytest.mark.slow
def test_config_and_parameter_counts_reach_every_logger(tmp_path):
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    run = _train(tmp_path, "logger=[csv,tensorboard,mlflow,wandb]")

    csv = yaml.safe_load((run / "csv" / "version_0" / "hparams.yaml").read_text())
    assert csv["model"]["optimizer"]["lr"] == LR
    assert csv["model/params/total"] == csv["model/params/trainable"] == MLP_PARAMS
    assert csv["data"]["batch_size"] == 128 and csv["trainer"]["max_epochs"] == 1 and csv["seed"] == 12345

    tb_dir = run / "tensorboard" / "version_0"
    assert yaml.safe_load((tb_dir / "hparams.yaml").read_text())["model/params/total"] == MLP_PARAMS
    tb = _tensorboard_hparams(tb_dir)
    assert tb["model/optimizer/lr"] == pytest.approx(LR)
    assert tb["model/params/total"] == MLP_PARAMS and tb["seed"] == 12345

    (params,) = _mlflow_params(tmp_path)
    assert float(params["model/optimizer/lr"]) == LR
    assert int(params["model/params/total"]) == MLP_PARAMS and params["seed"] == "12345"
    assert params["trainer/max_epochs"] == "1" and params["data/batch_size"] == "128"

    (wandb_run,) = run.glob("wandb/offline-run-*/run-*.wandb")
    wb = _wandb_config(wandb_run)
    assert wb["model"]["optimizer"]["lr"] == LR
    assert wb["model/params/total"] == MLP_PARAMS and wb["seed"] == 12345


@pytest.mark.slow
def test_hyperparameters_logged_once_from_rank_zero_under_ddp(tmp_path):
    pytest.importorskip("mlflow")
    run = _train(tmp_path, "trainer=ddp", "trainer.devices=2", "logger=[csv,mlflow]")
    runs = _mlflow_params(tmp_path)
    assert len(runs) == 1, "one MLflow run for the whole DDP job"
    assert float(runs[0]["model/optimizer/lr"]) == LR and int(runs[0]["model/params/total"]) == MLP_PARAMS
    hparams = list(run.glob("csv/*/hparams.yaml"))
    assert len(hparams) == 1 and yaml.safe_load(hparams[0].read_text())["model/params/total"] == MLP_PARAMS


@pytest.mark.fast
def test_nothing_to_log_without_a_logger(cfg_train):
    trainer = Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    log_hyperparameters({"cfg": cfg_train, "model": nn.Linear(2, 2), "trainer": trainer})
    assert not any(isinstance(cb, HyperparameterLogger) for cb in trainer.callbacks)


@pytest.mark.fast
def test_dotenv_keys_loaded_shell_wins(tmp_path, monkeypatch):
    env_file = tmp_path / ".env"
    env_file.write_text("LHT_TEST_KEY=from-file\nLHT_TEST_SHELL=from-file\n")
    for name in ("LHT_TEST_KEY", "LHT_TEST_SHELL"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)  # restored (unset) after the test
    monkeypatch.setenv("LHT_TEST_SHELL", "from-shell")
    LoadDotenv(str(env_file)).on_job_start(config=None)
    assert os.environ["LHT_TEST_KEY"] == "from-file"
    assert os.environ["LHT_TEST_SHELL"] == "from-shell"


@pytest.mark.slow
def test_a_ddp_spawn_multirun_logs_every_job_to_wandb(tmp_path):
    """Job 1 of a ``trainer=ddp_spawn logger=wandb`` multirun attaches to the wandb service job 0 started: the
    variable wandb keeps it in outlives the job (``hydra_launch.KEPT_ACROSS_JOBS``). Before, job 1 failed."""
    pytest.importorskip("wandb")
    proc = run_entry("train", "-m", *TINY, "trainer=ddp_spawn", "trainer.devices=2", "logger=wandb", "seed=1,2",
                     "test=false", f"paths.log_dir={tmp_path}", env={"WANDB_SILENT": "true", "WANDB_MODE": "offline"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = sorted(tmp_path.glob("train/multiruns/*/*/wandb/offline-run-*/run-*.wandb"))
    assert len(runs) == 2, runs
    assert {_wandb_config(run)["seed"] for run in runs} == {1, 2}


@pytest.mark.fast
def test_a_new_csv_column_never_leaves_the_file_half_written(tmp_path, monkeypatch):
    """CSVLogger rewrites metrics.csv in place when a column appears (a kill then emptied it). Here the wider
    file is written aside and swapped in: a failure before the swap leaves every earlier row in place."""
    import csv as csv_module

    from src.engine.loggers import resumable
    from src.engine.loggers.resumable import ResumableCSVLogger

    logger = ResumableCSVLogger(str(tmp_path))
    for step in range(3):
        logger.log_metrics({"lr": 0.1}, step=step)

    def killed(*args):
        raise KeyboardInterrupt("killed before the swap")

    monkeypatch.setattr(resumable.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        logger.log_metrics({"lr": 0.1, "val/acc": 0.5}, step=3)
    with open(logger.metrics_file, newline="") as f:
        assert [row["step"] for row in csv_module.DictReader(f)] == ["0", "1", "2"]
    monkeypatch.undo()
    logger.log_metrics({"lr": 0.1, "val/acc": 0.5}, step=3)
    with open(logger.metrics_file, newline="") as f:
        rows = list(csv_module.DictReader(f))
    assert [r["step"] for r in rows] == ["0", "1", "2", "3"] and rows[-1]["val/acc"] == "0.5"


@pytest.mark.fast
def test_a_resume_sends_each_point_a_logger_lacks_once_wherever_the_kill_and_the_checkpoint_fell():
    """A logger holds a prefix of the points; the resume replays them from its checkpoint's step in the same
    order (``epoch`` twice at an epoch's last step: training's and validation's epoch end). Held and sent
    together are every point exactly once, for every cut and every replay start at or before it."""
    from src.engine.loggers.resumable import HeldPoints

    calls = []  # (step, metrics) in the order Lightning logs them
    for step in range(12):
        calls.append((step, {"lr": 0.1 * step, "train/loss": 1.0 / (step + 1)}))
        if step % 4 == 3:
            calls += [(step, {"val/acc": step / 12, "epoch": step // 4}), (step, {"train/acc": 0.5, "epoch": step // 4})]
    points = [(step, key, value) for step, metrics in calls for key, value in metrics.items()]
    for cut in range(len(calls) + 1):
        held_points = points[:sum(len(m) for _, m in calls[:cut])]
        for resume_step in range(calls[cut - 1][0] + 1 if cut else 1):
            held = HeldPoints()
            for step, metrics in calls[:cut]:
                held.add(metrics, step)
            sent = [(step, key, value) for step, metrics in calls if step >= resume_step
                    for key, value in held.unsent(metrics, step).items()]
            assert sorted(held_points + sent) == sorted(points), (cut, resume_step)


@pytest.mark.fast
def test_the_removed_wandb_logger_target_still_builds_lightnings_for_one_release(tmp_path):
    """Older configs name ``src.engine.loggers.resumable.ResumableWandbLogger``: it builds
    Lightning's WandbLogger and warns with the target to use (docs/migration.md)."""
    pytest.importorskip("wandb")
    from lightning.pytorch.loggers import WandbLogger

    from src.engine.loggers.resumable import ResumableWandbLogger

    with pytest.warns(DeprecationWarning, match="lightning.pytorch.loggers.wandb.WandbLogger"):
        logger = ResumableWandbLogger(save_dir=str(tmp_path), offline=True, id="old", resume="allow", prefix="")
    assert type(logger) is WandbLogger and logger.version == "old"
