"""A user's own LightningModule and DataModule, not written to this project's protocol, get the guarantees.

Subjects (tests/subjects/): (a) a classifier in the style of ashleve's template (its ``net`` and optimizer and
scheduler partials saved as hyper-parameters, ``ReduceLROnPlateau`` on ``val/loss``, empty epoch-end hooks,
torchmetrics) with (d) its data module (torchvision's FashionMNIST in plain ``DataLoader``\\ s, ``shuffle=True``,
two workers, a list argument from Hydra); (b) Lightning's demo modules as the installed package ships them;
(c) a GAN-like module with two optimizers under manual optimization. Every run is a real ``src/*.py`` process;
the tests compare weights, metrics and logged rows.
"""

from __future__ import annotations

import csv
import gzip
import os
import re
import shutil
import signal
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers.config import ROOT
from tests.helpers.entry import run_entry
from tests.helpers.training_runs import finish, launch, run_dirs, wait_for_checkpoint

pytestmark = pytest.mark.slow

SUBJECTS = "hydra.searchpath=[file://tests/subjects/configs]"
SHORT = ["extras.print_config=false", "logger=csv", "++callbacks.metric_plot=null"]
FASHION = "/usr/share/datasets/fashion-mnist"


@pytest.fixture(scope="module")
def fashion_root(tmp_path_factory) -> Path:
    """torchvision's FashionMNIST layout (``<root>/FashionMNIST/raw``), from Debian's files: no download."""
    if not Path(FASHION).is_dir():
        pytest.skip(f"needs Debian's dataset-fashion-mnist in {FASHION} (make install)")
    root = tmp_path_factory.mktemp("fashion")
    raw = root / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    for gz in Path(FASHION).glob("*.gz"):
        with gzip.open(gz) as src, open(raw / gz.stem, "wb") as dst:
            shutil.copyfileobj(src, dst)
    return root


def ashleve(root: Path) -> list[str]:
    """The module and data config (what every entry point takes), with a 1024-sample test split."""
    return [SUBJECTS, "model=ashleve_classifier", "data=ashleve_fashion_mnist", f"paths.data_dir={root}",
            "data.train_val_test_split=[60000,8976,1024]", "extras.print_config=false"]


def ashleve_training(root: Path) -> list[str]:
    return [*ashleve(root), "trainer.max_epochs=3", "+trainer.limit_train_batches=10", "+trainer.limit_val_batches=4",
            "logger=csv", "++callbacks.metric_plot=null"]


def status(run_dir: Path) -> dict:
    return yaml.safe_load((run_dir / "status.yaml").read_text())


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from src.engine.checkpointing.io import load_checkpoint_file

    return load_checkpoint_file(run_dir / "checkpoints" / "last.ckpt")["state_dict"]


def differing(a: Path, b: Path) -> list[str]:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    return [k for k in wa if not torch.equal(wa[k], wb[k])]


def logged_steps_twice(run_dir: Path) -> list[tuple[str, str]]:
    """``(step, metric)`` pairs written more than once in the run's CSV log."""
    seen, twice = set(), []
    with open(run_dir / "csv" / "version_0" / "metrics.csv", newline="") as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if value and key not in ("step", "epoch"):
                    pair = (row["step"], key)
                    (twice.append if pair in seen else seen.add)(pair)
    return twice


def logged(run_dir: Path, metric: str) -> list[float]:
    with open(run_dir / "csv" / "version_0" / "metrics.csv", newline="") as f:
        return [float(row[metric]) for row in csv.DictReader(f) if row.get(metric)]


def train(tmp: Path, *overrides: str) -> Path:
    proc = run_entry("train", *overrides, f"hydra.run.dir={tmp}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp


def killed(log_dir: Path, *overrides: str, sig: int = signal.SIGKILL) -> tuple[Path, list[str]]:
    """Start ``src/train.py``; send ``sig`` to every process once its first ``last.ckpt`` is written: the run dir, and
    the command to run it again. A SIGTERM is a preemption: the run stops on every rank and exits 143."""
    command = [sys.executable, str(ROOT / "src" / "train.py"), *overrides, f"paths.log_dir={log_dir}"]
    proc = launch(command)
    wrote = wait_for_checkpoint(proc, log_dir)
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
    finish(proc)
    expected = -signal.SIGKILL if sig == signal.SIGKILL else 128 + sig
    assert wrote and proc.returncode == expected, f"the run ended otherwise: {proc.stderr_text[-2000:]}"
    (run_dir,) = run_dirs(log_dir)
    return run_dir, command


def killed_and_resumed(log_dir: Path, *overrides: str, sig: int = signal.SIGKILL) -> Path:
    """:func:`killed`, then the same command again, to its end: the run dir."""
    run_dir, command = killed(log_dir, *overrides, sig=sig)
    again = launch(command)
    assert finish(again) == 0, again.stderr_text[-3000:]
    return run_dir


# -- (a) + (d): ashleve's style -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ashleve_run(fashion_root, tmp_path_factory) -> Path:
    """One uninterrupted run of the ashleve-style module and data, with its test."""
    return train(tmp_path_factory.mktemp("ashleve") / "run", *ashleve_training(fashion_root))


def test_its_checkpoints_load_in_every_entry_point(ashleve_run, fashion_root, tmp_path):
    trained = status(ashleve_run)
    assert trained["status"] == "finished"
    saved = torch.load(ashleve_run / "checkpoints" / "last.ckpt", weights_only=True)  # no object to unpickle
    assert saved["hyper_parameters"]["net"].startswith("<not saved: an nn.Module of class ")
    assert saved["datamodule_hyper_parameters"]["train_val_test_split"] == [60000, 8976, 1024]
    (best,) = (ashleve_run / "checkpoints").glob("epoch_*.ckpt")

    evaluated = run_entry("eval", *ashleve(fashion_root), f"ckpt_path={best}", f"hydra.run.dir={tmp_path}/eval",
                          "logger=csv")
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert logged(tmp_path / "eval", "test/acc") == [trained["metrics"]["test/acc"]]

    predicted = run_entry("predict", *ashleve(fashion_root), f"ckpt_path={best}", "input=test",
                          f"hydra.run.dir={tmp_path}/predict")
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    with open(tmp_path / "predict" / "predictions.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["source"] for r in rows] == [f"test[{i}]" for i in range(1024)]
    scores = torch.tensor([[float(r[f"out_{k}"]) for k in range(10)] for r in rows])
    labels = torch.tensor([int(r["label"]) for r in rows])
    assert (scores.argmax(1) == labels).float().mean().item() == pytest.approx(trained["metrics"]["test/acc"], abs=1e-6)

    exported = run_entry("export", *ashleve(fashion_root), f"ckpt_path={best}", f"output={tmp_path}/model.onnx",
                         f"hydra.run.dir={tmp_path}/export")
    assert exported.returncode == 0, exported.stderr[-3000:]
    within = float(re.search(r"matches the model within (\S+)", exported.stdout + exported.stderr)[1])
    assert (tmp_path / "model.onnx").is_file() and within <= 1e-4


@pytest.mark.faults
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["kill-9", "sigterm"])
def test_a_kill_resumes_it_bit_exact_and_its_log_has_no_step_twice(sig, ashleve_run, fashion_root, tmp_path):
    run_dir = killed_and_resumed(tmp_path, *ashleve_training(fashion_root), sig=sig)
    said = (run_dir / "train.log").read_text()  # plain DataLoaders: epoch-end checkpoints, said in one line
    assert "FashionMNISTData (a DataLoader) cannot resume mid-epoch, so last.ckpt is written at epoch ends" in said
    assert not differing(ashleve_run, run_dir)
    assert not logged_steps_twice(run_dir)
    assert status(run_dir)["metrics"]["test/acc"] == status(ashleve_run)["metrics"]["test/acc"]


@pytest.mark.faults
def test_under_ddp_it_shards_and_resumes_on_another_number_of_ranks(fashion_root, tmp_path):
    run_dir, _ = killed(tmp_path, *ashleve_training(fashion_root), "trainer=ddp", "trainer.devices=2")
    epoch_saved = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["epoch"]
    # the same run on one process: it continues from the 2 ranks' epoch-end checkpoint
    resumed = run_entry("train", *ashleve_training(fashion_root), f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}",
                        f"hydra.run.dir={tmp_path}/one")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    final = torch.load(tmp_path / "one" / "checkpoints" / "last.ckpt", weights_only=True)
    assert final["epoch"] == 3 and epoch_saved <= 2  # the fit ran to max_epochs=3
    assert final["global_step"] == 30  # 3 epochs of 10 steps: the epoch it stopped in ran again whole
    assert not logged_steps_twice(tmp_path / "one")


# -- (b) Lightning's demo modules ----------------------------------------------------------------------------------
BORING = [SUBJECTS, "model=boring", "data=boring", "optimized_metric=null", "trainer.max_epochs=2", *SHORT]


@pytest.mark.fast
def test_a_module_that_does_not_log_the_optimized_metric_is_told_in_one_line(tmp_path):
    proc = run_entry("train", *BORING[:3], *SHORT, f"hydra.run.dir={tmp_path}/run")
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and errors, proc.stderr[-2000:]
    assert errors[0].startswith("error: optimized_metric=val/acc is not logged by BoringModel: after the sanity "
                                "check's validation it logged no metric; fix: ") and "optimized_metric=null" in errors[0]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("trainer", ["default", "ddp", "ddp_spawn", "ddp_fork", "fsdp", "ps"])
def test_lightnings_boring_model_trains_on_every_trainer_that_takes_any_module(trainer, tmp_path):
    devices = {"default": 1, "ps": 3}.get(trainer, 2)
    run = train(tmp_path / "run", *BORING, f"trainer={trainer}", f"trainer.devices={devices}")
    assert status(run)["status"] == "finished"
    assert "test/loss" not in status(run)["metrics"]  # BoringModel logs nothing: nothing is made up
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] > 0 if trainer != "fsdp" \
        else (run / "checkpoints" / "last.ckpt").is_dir()


@pytest.mark.parametrize("model", ["manual_boring", "demo"])
def test_lightnings_other_demo_modules_train_and_export(model, tmp_path):
    extra = ["test=false"] if model == "demo" else []  # DemoModel has no test_step
    run = train(tmp_path / "run", SUBJECTS, f"model={model}", "data=boring", "optimized_metric=null",
                "trainer.max_epochs=2", *SHORT, *extra)
    exported = run_entry("export", SUBJECTS, f"model={model}", "data=boring", f"ckpt_path={run}/checkpoints/last.ckpt",
                         f"output={tmp_path}/model.onnx", f"hydra.run.dir={tmp_path}/export", "extras.print_config=false")
    assert exported.returncode == 0, exported.stderr[-3000:]


@pytest.mark.fast
def test_eval_of_a_module_without_test_step_is_one_line(tmp_path):
    run = train(tmp_path / "run", SUBJECTS, "model=demo", "data=boring", "optimized_metric=null", "test=false",
                "trainer.max_epochs=1", *SHORT)
    proc = run_entry("eval", SUBJECTS, "model=demo", "data=boring", f"ckpt_path={run}/checkpoints/last.ckpt",
                     f"hydra.run.dir={tmp_path}/eval", "extras.print_config=false")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == ("error: eval.py runs DemoModel.test_step, which it does not "
                                                    "define; fix: define test_step (it logs the test metrics), or "
                                                    "predict with src/predict.py")


@pytest.mark.fast
def test_training_with_test_true_of_a_module_without_test_step_is_one_line(tmp_path):
    proc = run_entry("train", SUBJECTS, "model=demo", "data=boring", "optimized_metric=null", "test=true",
                     *SHORT, f"hydra.run.dir={tmp_path}/run")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == ("error: train.py (test=true) runs DemoModel.test_step, which it "
                                                    "does not define; fix: test=false, or define test_step")
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.faults
def test_under_ps_boring_model_resumes_after_a_kill(tmp_path):
    boring = [o for o in BORING if not o.startswith("trainer.max_epochs")]
    run_dir = killed_and_resumed(tmp_path, *boring, "trainer=ps", "trainer.devices=3", "trainer.max_epochs=10")
    assert status(run_dir)["status"] == "finished"
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["epoch"] == 10


# -- (c) two optimizers, manual optimization -----------------------------------------------------------------------
GAN = [SUBJECTS, "model=gan", "data=gaussian_points", "data.n=4096", "optimized_metric=val/d_loss",
       "optimized_mode=min", "trainer.max_epochs=4", *SHORT]


def gan_trainer(trainer: str) -> list[str]:
    extra = [f"trainer={trainer}", f"trainer.devices={1 if trainer == 'default' else 2}"]
    if trainer.startswith("ddp"):  # each optimizer's loss leaves the other network's parameters unused
        extra.append("trainer.strategy.find_unused_parameters=true")
    return extra


@pytest.fixture(scope="module")
def gan_reference(tmp_path_factory):
    """trainer -> an uninterrupted GAN run, made on first use. ddp, ddp_spawn and ddp_fork launch the same DDP on
    two ranks, so one ``trainer=ddp`` run is the reference of all three (their results must not differ either)."""
    runs: dict[str, Path] = {}

    def reference(trainer: str) -> Path:
        family = "ddp" if trainer.startswith("ddp") else trainer
        if family not in runs:
            runs[family] = train(tmp_path_factory.mktemp(f"gan_{family}") / "run", *GAN, *gan_trainer(family))
        return runs[family]

    return reference


@pytest.mark.faults
@pytest.mark.parametrize("trainer", ["default", "ddp", "ddp_spawn", "ddp_fork", "fsdp"])
def test_a_gan_with_two_optimizers_resumes_bit_exact_after_a_kill(trainer, gan_reference, tmp_path):
    reference = gan_reference(trainer)
    run_dir = killed_and_resumed(tmp_path / "killed", *GAN, *gan_trainer(trainer))
    assert not differing(reference, run_dir)
    assert not logged_steps_twice(run_dir)
    assert status(run_dir)["metrics"]["test/d_loss"] == status(reference)["metrics"]["test/d_loss"]
