"""``trainer=pipeline`` from the command line, as a user runs it: real Fashion-MNIST, checkpoints, resume.

One pipeline training run (2 stages, one epoch of the MLP without dropout) is shared by the
tests below; each other run is a separate ``python src/<entry>.py`` process.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from tests.helpers.entry import run_entry
from tests.helpers.run_if import gpu_test

COMMON = ["model.net.dropout=0", "trainer.max_epochs=1", "extras.print_config=false", "logger=csv",
          "callbacks.model_summary.max_depth=1"]


def _test_metrics(run_dir: Path) -> dict[str, float]:
    with open(run_dir / "csv" / "version_0" / "metrics.csv") as file:
        rows = list(csv.DictReader(file))
    return {k: float(v) for row in rows for k, v in row.items() if k.startswith("test/") and v}


def _ok(proc) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pipeline_fashion")
    _ok(run_entry("train", "trainer=pipeline", "trainer.devices=2", "trainer.accelerator=cpu", *COMMON,
                  f"hydra.run.dir={out}", timeout=600))
    return out


@pytest.mark.slow
def test_pipeline_training_matches_one_device(pipeline_run, tmp_path):
    """Proof 2: one epoch of the Fashion-MNIST MLP, 2 pipeline stages, within 0.5 points of one device.

    Every strategy cuts an epoch into the same global batches, so both runs see the same samples in
    the same order (with another order, one epoch's accuracy moves by ~1.5 points with the order alone).
    """
    _ok(run_entry("train", "trainer=default", "trainer.accelerator=cpu", *COMMON,
                  f"hydra.run.dir={tmp_path}", timeout=600))
    piped, single = _test_metrics(pipeline_run), _test_metrics(tmp_path)
    assert single["test/acc"] > 0.80  # a real, learnt model
    assert abs(piped["test/acc"] - single["test/acc"]) <= 0.005, (piped, single)


@pytest.mark.slow
def test_pipeline_checkpoint_evaluates_on_one_device(pipeline_run, tmp_path):
    """Proof 3a: the pipeline's checkpoint is one full model; src/eval.py on one device reproduces its test metrics."""
    best = next((pipeline_run / "checkpoints").glob("epoch_*.ckpt"))
    state = torch.load(best, map_location="cpu", weights_only=False)
    assert {k.split(".")[1] for k in state["state_dict"] if k.startswith("net.")} == {"fc0", "fc1", "head"}
    assert state["optimizer_states"][0]["param_groups"][0]["param_names"][0] == "net.fc0.1.weight"
    _ok(run_entry("eval", "trainer=cpu", f"ckpt_path={best}", "extras.print_config=false", "logger=csv",
                  f"hydra.run.dir={tmp_path}", timeout=300))
    piped, single = _test_metrics(pipeline_run), _test_metrics(tmp_path)
    for key in ("test/acc", "test/loss"):
        assert abs(piped[key] - single[key]) <= 1e-6, (key, piped, single)


@pytest.mark.slow
def test_pipeline_resumes_from_its_checkpoint(pipeline_run, tmp_path):
    """Proof 3b: resuming a pipeline run restores weights, optimizer and loops, and continues from the saved step."""
    last = pipeline_run / "checkpoints" / "last.ckpt"
    saved = torch.load(last, map_location="cpu", weights_only=False)
    proc = run_entry("train", "trainer=pipeline", "trainer.devices=2", "trainer.accelerator=cpu", *COMMON,
                     "trainer.max_epochs=2",
                     "+trainer.limit_train_batches=10", "+trainer.limit_val_batches=5", "test=false",
                     f"ckpt_path={last}", f"hydra.run.dir={tmp_path}", timeout=600)
    _ok(proc)
    assert "Restored all states from the checkpoint" in proc.stdout + proc.stderr
    resumed = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    # last.ckpt is also written at the end of training, after the epoch counter moved on: 1 epoch, then 2
    assert saved["epoch"] == 1 and resumed["epoch"] == 2
    assert resumed["global_step"] == saved["global_step"] + 10


def _epoch_train_loss(run_dir: Path) -> float:
    with open(run_dir / "csv" / "version_0" / "metrics.csv") as file:
        (loss,) = [float(row["train/loss"]) for row in csv.DictReader(file) if row.get("train/loss")]
    return loss


@pytest.mark.slow
def test_a_mid_epoch_checkpoint_moves_between_pipeline_and_data_parallel_runs(tmp_path):
    """The epoch's running training metrics are kept once per data-parallel replica (a pipeline's stages hold
    one copy), so a mid-epoch checkpoint resumed under another strategy logs the epoch's training loss over all
    its batches: pipeline -> one process, and DDP x2 -> pipeline."""
    steps = [*COMMON, "+trainer.limit_train_batches=10", "+trainer.limit_val_batches=1", "test=false"]
    pipeline, ddp = ["trainer=pipeline", "trainer.devices=2"], ["trainer=ddp", "trainer.devices=2"]
    _ok(run_entry("train", "trainer=cpu", *steps, f"hydra.run.dir={tmp_path / 'reference'}", timeout=300))
    expected = _epoch_train_loss(tmp_path / "reference")
    for name, first, then in (("pipeline-to-one", pipeline, ["trainer=cpu"]), ("ddp-to-pipeline", ddp, pipeline)):
        mid_epoch = tmp_path / f"{name}.ckpt"  # the periodic last.ckpt of step 6, kept before later saves
        _ok(run_entry("train", *first, "trainer.accelerator=cpu", *steps, "last_ckpt_every_n_train_steps=6",
                      "+callbacks.copy._target_=tests.helpers.checkpoint_copy.CopyLastCheckpoint",
                      "+callbacks.copy.step=6", f"+callbacks.copy.dest={mid_epoch}",
                      f"hydra.run.dir={tmp_path / name / 'first'}", timeout=300))
        saved = torch.load(mid_epoch, map_location="cpu", weights_only=False)
        assert saved["global_step"] == 6 and len(saved["running_metrics_per_rank"]) == (1 if first == pipeline else 2)
        _ok(run_entry("train", *then, "trainer.accelerator=cpu", *steps, f"ckpt_path={mid_epoch}",
                      f"hydra.run.dir={tmp_path / name / 'resumed'}", timeout=300))
        assert _epoch_train_loss(tmp_path / name / "resumed") == pytest.approx(expected, rel=1e-5), name


@pytest.mark.slow
def test_pipeline_with_spawned_ranks(tmp_path):
    """`start_method: spawn` pickles the trainer, with the strategy's launcher and checks, into each rank."""
    proc = run_entry("train", "trainer=pipeline", "trainer.devices=2", "trainer.accelerator=cpu",
                     "trainer.strategy.start_method=spawn", *COMMON,
                     "+trainer.limit_train_batches=4", "+trainer.limit_val_batches=2", "+trainer.limit_test_batches=2",
                     f"hydra.run.dir={tmp_path}", timeout=600)
    _ok(proc)
    # Each spawn launch (fit, then test) is a fresh process; the run's CSV logger continues its one version.
    assert [p.name for p in (tmp_path / "csv").iterdir()] == ["version_0"]
    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as file:
        test_acc = [float(row["test/acc"]) for row in csv.DictReader(file) if row.get("test/acc")]
    assert len(test_acc) == 1 and 0.0 < test_acc[0] <= 1.0


@pytest.mark.slow
def test_bf16_true_pipeline_with_time_balance_on_cpu(tmp_path):
    """bf16-true: blocks and inputs share one dtype, in the timing pass of balance=time and in every step."""
    _ok(run_entry("train", "trainer=pipeline", "trainer.devices=1", "trainer.accelerator=cpu",
                  "trainer.precision=bf16-true", "trainer.strategy.balance=time", *GPU_COMMON,
                  f"hydra.run.dir={tmp_path}", timeout=600))
    assert 0.0 < _test_metrics(tmp_path)["test/acc"] <= 1.0


# -- on GPUs: the split happens on the host, then each rank's blocks move to its own GPU -----------------
GPU_COMMON = ["trainer.max_epochs=1", "++trainer.limit_train_batches=8", "++trainer.limit_val_batches=2",
              "++trainer.limit_test_batches=2", "extras.print_config=false", "logger=csv"]


@gpu_test(1)
@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_one_stage_pipeline_on_a_gpu(tmp_path, precision):
    """A 1-stage pipeline (nccl, one rank) trains and tests in bf16; bf16-true with balance=time times each block
    on the GPU with an input converted like the blocks (a dtype mismatch failed here before)."""
    _ok(run_entry("train", "trainer=pipeline", "trainer.devices=1", "trainer.accelerator=gpu",
                  f"trainer.precision={precision}", "trainer.strategy.balance=time", *GPU_COMMON,
                  f"hydra.run.dir={tmp_path}", timeout=600))
    metrics = _test_metrics(tmp_path)
    assert 0.0 < metrics["test/acc"] <= 1.0 and metrics["test/loss"] == metrics["test/loss"]  # finite, learnt


@gpu_test(2)
def test_two_stage_pipeline_over_nccl(tmp_path):
    """2 stages on 2 GPUs exchange activations and gradients over nccl, and the checkpoint evaluates on one GPU."""
    _ok(run_entry("train", "trainer=pipeline", "trainer.devices=2", "trainer.accelerator=gpu", *GPU_COMMON,
                  f"hydra.run.dir={tmp_path}", timeout=600))
    assert 0.0 < _test_metrics(tmp_path)["test/acc"] <= 1.0
    ckpt = next((tmp_path / "checkpoints").glob("*.ckpt"))
    _ok(run_entry("eval", f"ckpt_path={ckpt}", "trainer.accelerator=gpu", "logger=csv",
                  f"hydra.run.dir={tmp_path}/eval", timeout=600))
