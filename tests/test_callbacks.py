"""The project's callbacks and speed-related module behaviour, in short real fits."""

from __future__ import annotations

import hydra
import pytest
import torch
from lightning import Callback
from lightning.pytorch.callbacks import DeviceStatsMonitor, LearningRateMonitor, RichProgressBar
from lightning.pytorch.loggers import CSVLogger
from torch import nn

import src.train as entry
from src.data.mnist_datamodule import MNISTDataModule
from src.engine.callbacks.progress_bar import RateLimitedRichProgressBar
from src.engine.utils.instantiators import drop_callbacks_needing_a_logger
from src.models.components.mlp import MLP
from src.train import train


class _BarProbe(Callback):
    """Records where the training bar stands when validation starts and at each epoch end (after the bar's hooks)."""

    def __init__(self) -> None:
        self.at_validation: list[float] = []
        self.completed: list[float] = []

    @staticmethod
    def _position(trainer) -> float:
        bar = trainer.progress_bar_callback
        return bar.progress.tasks[bar.train_progress_bar_id].completed

    def on_validation_start(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self.at_validation.append(self._position(trainer))

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.completed.append(self._position(trainer))


@pytest.mark.slow
def test_rate_limited_bar_skips_updates_but_ends_each_epoch_at_the_total(make_cfg, monkeypatch):
    cfg = make_cfg(
        "train", ["trainer.max_epochs=2", "test=false", "callbacks.rich_progress_bar.refresh_rate=1"]
    )
    calls = []  # batch_idx of every update that reached Lightning's bar
    parent = RichProgressBar.on_train_batch_end
    monkeypatch.setattr(
        RichProgressBar, "on_train_batch_end", lambda self, *a: (calls.append(a[-1]), parent(self, *a))
    )
    probe = _BarProbe()
    real = entry.instantiate_callbacks
    monkeypatch.setattr(entry, "instantiate_callbacks", lambda c: [*real(c), probe])
    _, objects = train(cfg)
    assert isinstance(objects["trainer"].progress_bar_callback, RateLimitedRichProgressBar)
    assert probe.completed == [8, 8]  # 8 batches per epoch (limit_train_batches)
    assert probe.at_validation == [8, 8]  # not stale while validation runs
    # One update per second at most: the first batch of each epoch and the epoch's end, not all 16.
    assert len(calls) < 16
    assert calls.count(7) == 2


@pytest.mark.fast
def test_step_module_setattr_fast_path_keeps_module_semantics(make_cfg, monkeypatch):
    model = hydra.utils.instantiate(make_cfg("train").model)
    slow = nn.Module.__setattr__

    def refuse_fx_name(self, name, value):
        assert name != "_current_fx_name", "the fast path must not reach nn.Module.__setattr__"
        slow(self, name, value)

    monkeypatch.setattr(nn.Module, "__setattr__", refuse_fx_name)
    model._current_fx_name = "training_step"
    assert model._current_fx_name == "training_step"
    model.extra = nn.Linear(2, 2)  # other attributes still go through nn.Module registration
    assert "extra" in model._modules and any(n.startswith("extra.") for n, _ in model.named_parameters())


@pytest.mark.fast
def test_mlp_batch_norm_replaces_the_hidden_bias():
    plain, normed = MLP(hidden_sizes=[32, 16]), MLP(hidden_sizes=[32, 16], batch_norm=True)
    assert sum(isinstance(m, nn.BatchNorm1d) for m in normed.modules()) == 2
    assert not any(isinstance(m, nn.BatchNorm1d) for m in plain.modules())
    assert normed.fc0[1].bias is None and plain.fc0[1].bias is not None


@pytest.mark.fast
@pytest.mark.parametrize("dataset", ["fashion_mnist", "mnist"])
def test_mnist_augmentation_shifts_and_flips_only_training_batches(dataset):
    torch.manual_seed(0)
    dm = MNISTDataModule(dataset=dataset, augment=True)
    images = torch.randint(1, 256, (64, 1, 28, 28), dtype=torch.uint8)
    plain = MNISTDataModule(dataset=dataset).transform_batch(images, training=True)
    assert torch.equal(dm.transform_batch(images, training=False), plain)  # evaluation is never augmented
    out = dm.transform_batch(images, training=True)
    assert out.shape == plain.shape and not torch.equal(out, plain)

    background = dm.transform_batch(torch.zeros(1, 1, 1, 1, dtype=torch.uint8), training=False)  # the padding
    padded = torch.nn.functional.pad(plain, (2, 2, 2, 2), value=float(background))
    crops = [padded[:, :, dy : dy + 28, dx : dx + 28] for dy in range(5) for dx in range(5)]
    shifted = torch.stack([torch.isclose(out, c).flatten(1).all(1) for c in crops]).any(0)
    flipped = torch.stack([torch.isclose(out, c.flip(3)).flatten(1).all(1) for c in crops]).any(0)
    assert bool((shifted | flipped).all())  # every image is a shift of the original or of its mirror
    if dataset == "fashion_mnist":
        assert int((flipped & ~shifted).sum()) > 0
    else:
        assert not bool((flipped & ~shifted).any())  # digits are never mirrored


@pytest.mark.slow
def test_logger_none_trains_without_the_lr_monitor(make_cfg):
    metrics, objects = train(make_cfg("train", ["logger=none"]))
    trainer = objects["trainer"]
    assert trainer.loggers == [] and trainer.global_step == 8 and "test/acc" in metrics
    assert not any(isinstance(cb, LearningRateMonitor) for cb in trainer.callbacks)
    with_logger = train(make_cfg("train", ["test=false"], subdir="csv"))[1]["trainer"]
    assert any(isinstance(cb, LearningRateMonitor) for cb in with_logger.callbacks)  # kept when there is one


@pytest.mark.slow
@pytest.mark.parametrize(("overrides", "name", "better", "flattering"),
                         [([], "acc", max, 2.0), (["data=toy", "model=toy"], "loss", min, -1.0)])
def test_best_validation_value_is_tracked_over_epochs(make_cfg, monkeypatch, overrides, name, better, flattering):
    """``val/<name>_best`` is the best of the epochs' values; what the sanity check saw does not count."""
    class Record(Callback):
        def __init__(self) -> None:
            self.values: list[tuple[float, float]] = []

        def on_sanity_check_end(self, trainer, pl_module) -> None:  # a sanity pass that looked unbeatable
            getattr(pl_module, f"val_{name}_best").update(torch.tensor(flattering))

        def on_validation_end(self, trainer, pl_module) -> None:  # after the module's epoch-end hook
            if not trainer.sanity_checking:
                metrics = trainer.callback_metrics
                self.values.append((float(metrics[f"val/{name}"]), float(metrics[f"val/{name}_best"])))

    record = Record()
    cfg = make_cfg("train", [*overrides, "trainer.max_epochs=3", "test=false", "++trainer.num_sanity_val_steps=2"])
    real = entry.instantiate_callbacks
    monkeypatch.setattr(entry, "instantiate_callbacks", lambda c: [*real(c), record])
    train(cfg)
    assert len(record.values) == 3
    for epoch, (_, best_so_far) in enumerate(record.values):
        assert best_so_far == pytest.approx(better(v for v, _ in record.values[: epoch + 1]), abs=1e-7)


@pytest.mark.fast
def test_monitors_needing_a_logger_are_left_out_without_one():
    callbacks = [LearningRateMonitor(), DeviceStatsMonitor(), RichProgressBar()]
    assert drop_callbacks_needing_a_logger(callbacks, [CSVLogger("unused")]) == callbacks
    assert [type(cb) for cb in drop_callbacks_needing_a_logger(callbacks, [])] == [RichProgressBar]
