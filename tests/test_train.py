"""Short fits on every data x model pair, eval reproducing train's test metric, and resuming."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import open_dict

from src.engine.utils.task import get_metric_value
from src.eval import evaluate
from src.train import train

PAIRS = [
    ("fashion_mnist", "mlp", []),
    ("fashion_mnist", "resnet18", ["data.batch_size=32"]),
    ("cifar10", "mlp", ["data.batch_size=16"]),
    ("cifar10", "resnet18", ["data.batch_size=16"]),
    ("mnist", "mlp", []),
    ("toy", "toy", []),
]


@pytest.mark.parametrize(("data", "model", "extra"), PAIRS, ids=[f"{d}-{m}" for d, m, _ in PAIRS])
def test_fit_and_test_each_pair(make_cfg, synthetic_cifar10, mnist_format_dir, data, model, extra):
    overrides = [f"data={data}", f"model={model}", *extra]
    if data == "cifar10":  # SYNTHETIC files in the real format: exercises the loader, says nothing of accuracy
        overrides += [f"data.data_dir={synthetic_cifar10}", "data.verify_checksums=false", "data.download=false",
                      "data.val_size=100"]
    if data == "mnist":
        overrides += [f"data.data_dir={mnist_format_dir}", "data.download=false"]
    cfg = make_cfg("train", overrides)
    metrics, objects = train(cfg)
    assert torch.isfinite(metrics["test/loss"])
    assert objects["trainer"].global_step == 8
    if model != "toy":
        assert 0.0 <= float(metrics["test/acc"]) <= 1.0
    ckpt = Path(objects["trainer"].checkpoint_callback.best_model_path)
    assert ckpt.is_file() and ckpt.parent == Path(cfg.paths.output_dir) / "checkpoints"
    assert (Path(cfg.paths.output_dir) / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_eval_reproduces_train_test_metric(make_cfg):
    cfg = make_cfg("train", subdir="train")
    train_metrics, objects = train(cfg)
    ckpt = objects["trainer"].checkpoint_callback.best_model_path
    eval_cfg = make_cfg("eval", [f"ckpt_path={ckpt}"], subdir="eval")
    eval_metrics, _ = evaluate(eval_cfg)
    assert float(eval_metrics["test/acc"]) == pytest.approx(float(train_metrics["test/acc"]), abs=1e-7)
    assert float(eval_metrics["test/loss"]) == pytest.approx(float(train_metrics["test/loss"]), abs=1e-6)


def test_resume_continues_from_saved_step(make_cfg):
    first = make_cfg("train", ["test=false"], subdir="first")
    _, objects = train(first)
    assert objects["trainer"].global_step == 8
    last = Path(first.paths.output_dir) / "checkpoints" / "last.ckpt"
    saved = torch.load(last, map_location="cpu", weights_only=True)
    assert saved["global_step"] == 8 and saved["epoch"] == 1  # written at the end of training (one epoch done)

    second = make_cfg("train", [f"ckpt_path={last}", "trainer.max_epochs=2", "test=false"], subdir="second")
    _, objects = train(second)
    trainer = objects["trainer"]
    assert trainer.global_step == 16  # 8 restored + 8 new, not 8 from scratch
    assert trainer.current_epoch == 2
    assert last.is_file()  # the checkpoint we resumed from is untouched

    # the final checkpoint again: nothing left to train, and the optimized metric still comes back
    done = make_cfg("train", [f"ckpt_path={last}", "test=false"], subdir="third")
    metrics, objects = train(done)
    assert objects["trainer"].global_step == 8
    assert 0.0 <= float(metrics[done.optimized_metric]) <= 1.0
    assert get_metric_value(metrics, done.optimized_metric) == float(metrics[done.optimized_metric])


@pytest.mark.slow
def test_fashion_mnist_mlp_reaches_85_percent(make_cfg):
    """Real data: a short run of the default model clears 0.85 test accuracy."""
    cfg = make_cfg("train", ["trainer.max_epochs=2", "++trainer.limit_train_batches=1.0",
                             "++trainer.limit_val_batches=1.0", "++trainer.limit_test_batches=1.0"])
    with open_dict(cfg):
        cfg.callbacks.early_stopping.patience = 100
    metrics, _ = train(cfg)
    assert float(metrics["test/acc"]) >= 0.85


@pytest.mark.parametrize("override", [[], ["trainer.profiler=simple"]], ids=["default", "simple"])
def test_the_default_profiler_profiles_nothing_and_simple_still_profiles(make_cfg, override):
    """Lightning wraps every hook in ``trainer.profiler.profile``; the default hands back one shared no-op
    context (cheaper than Lightning's pass-through profiler). ``trainer.profiler=simple`` still times hooks."""
    from lightning.pytorch.profilers import SimpleProfiler

    from src.engine.utils.profiler import NoProfiler

    cfg = make_cfg("train", ["model=toy", "data=toy", "test=false", *override])
    _, objects = train(cfg)
    profiler, trainer = objects["trainer"].profiler, objects["trainer"]
    assert trainer.global_step > 0
    if override:
        assert isinstance(profiler, SimpleProfiler) and profiler.recorded_durations["run_training_batch"]
    else:
        assert isinstance(profiler, NoProfiler) and profiler.profile("a") is profiler.profile("b")
