"""The project's modules are safe to subclass (docs/subclassing.md): a subclass may switch to manual optimization
with Lightning's own ``self.automatic_optimization = False``, and may override any Lightning hook without calling
``super()``; the optimization never changes silently (a ReduceLROnPlateau steps where Lightning's automatic
optimization steps it), and what cannot work is refused in one line. Trained with ``lightning.Trainer`` and the
project's single-device strategy on a tiny in-memory data set."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lightning import Callback, Trainer
from torch.utils.data import DataLoader, TensorDataset

from src.engine.checkpointing.last_checkpoint import LastCheckpoint
from src.engine.strategies.single_device import SingleDeviceStrategy
from src.engine.utils.errors import ConfigError
from src.models.classification_module import ClassificationModule
from src.models.components.mlp import MLP

pytestmark = pytest.mark.fast

LR = 1e-3
# Every epoch after the first counts as no improvement (threshold 1e9): the learning rate halves at each epoch's end
PLATEAU = functools.partial(torch.optim.lr_scheduler.ReduceLROnPlateau, factor=0.5, patience=0, threshold=1e9,
                            threshold_mode="abs")
EPOCHS = 4
EXPECTED_LR = LR * 0.5 ** (EPOCHS - 1)  # 0.000125


def loader() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 1, 4, 4, generator=generator), torch.randint(0, 3, (64,), generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=16)


def build(cls: type = ClassificationModule, scheduler=PLATEAU, **options) -> ClassificationModule:
    torch.manual_seed(0)
    net = MLP(in_channels=1, image_size=4, hidden_sizes=(8,), num_classes=3, dropout=0.0)
    return cls(net=net, optimizer=functools.partial(torch.optim.Adam, lr=LR), scheduler=scheduler, **options)


def fit(module, epochs: int = EPOCHS, ckpt_path: str | None = None, callbacks=(), **trainer_options) -> Trainer:
    trainer = Trainer(strategy=SingleDeviceStrategy(), accelerator="cpu", max_epochs=epochs, logger=False,
                      enable_checkpointing=bool(callbacks), callbacks=list(callbacks), enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, **trainer_options)
    trainer.fit(module, loader(), loader(), ckpt_path=ckpt_path)
    return trainer


def lr_of(trainer: Trainer) -> float:
    return float(trainer.optimizers[0].param_groups[0]["lr"])


def weights(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


# -- Lightning's manual-optimization switch ---------------------------------------------------------------------


class ManualStep(ClassificationModule):
    """Lightning's documented manual optimization: the switch in ``__init__``, and a training_step of its own."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False
        self.manual_steps = 0

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        self.manual_steps += 1
        return loss


def test_a_subclass_that_switches_to_manual_optimization_runs_its_own_step():
    module = build(ManualStep, scheduler=None)
    before = weights(module)
    trainer = fit(module, epochs=2)
    assert module.automatic_optimization is False
    assert module.manual_steps == trainer.global_step == 2 * 4
    assert module._capture is None and module.step_capture_counts == (0, 0)
    after = weights(module)
    assert any(not torch.equal(before[k], after[k]) for k in before), "the manual step trained nothing"


def test_the_manual_switch_leaves_a_plateau_scheduler_to_the_users_step():
    """Under the user's manual optimization Lightning steps no scheduler, and nor does the project."""
    trainer = fit(build(ManualStep))
    assert lr_of(trainer) == LR


class ManualSwitchOnly(ClassificationModule):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False


def test_the_manual_switch_without_a_manual_step_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^ManualSwitchOnly sets automatic_optimization = False .*; fix: "):
        fit(build(ManualSwitchOnly), epochs=1)


class AutomaticSwitch(ClassificationModule):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = True


def test_the_automatic_switch_forces_lightnings_optimization():
    forced, lightning = build(AutomaticSwitch), build(owned_step=False)
    trainers = fit(forced), fit(lightning)
    assert forced.automatic_optimization is True and lightning.automatic_optimization is True
    assert lr_of(trainers[0]) == lr_of(trainers[1]) == EXPECTED_LR
    a, b = weights(forced), weights(lightning)
    assert all(torch.equal(a[k], b[k]) for k in a)


class OwnTrainingStep(ClassificationModule):
    """A training_step as lightning-hydra-template writes it: it returns the loss, Lightning optimizes."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train/loss", loss)
        return loss


def test_a_training_step_of_its_own_keeps_lightnings_optimization():
    module = build(OwnTrainingStep, scheduler=None)
    before = weights(module)
    fit(module, epochs=1)
    assert module.automatic_optimization is True
    after = weights(module)
    assert any(not torch.equal(before[k], after[k]) for k in before), "the returned loss was never optimized"


# -- hooks overridden without super() ---------------------------------------------------------------------------


class EmptyTrainEpochEnd(ClassificationModule):
    def on_train_epoch_end(self) -> None:  # lightning-hydra-template's module ships exactly this
        pass


class EmptyValidationEpochEnd(ClassificationModule):
    def on_validation_epoch_end(self) -> None:
        pass


class EmptyTrainStart(ClassificationModule):
    def on_train_start(self) -> None:
        pass


class EmptyFitStart(ClassificationModule):
    def on_fit_start(self) -> None:
        pass


class EmptyTrainEnd(ClassificationModule):
    def on_train_end(self) -> None:
        pass


class EmptySetup(ClassificationModule):
    def setup(self, stage: str) -> None:
        pass


class OwnSchedulerStep(ClassificationModule):
    """``lr_scheduler_step`` as Lightning documents it for a custom scheduler, without super()."""

    def lr_scheduler_step(self, scheduler, metric) -> None:
        if metric is None:
            scheduler.step()
        else:
            scheduler.step(metric)


class OwnOptimizers(ClassificationModule):
    """``configure_optimizers`` as lightning-hydra-template writes it, with its own monitor."""

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=LR)
        scheduler = PLATEAU(optimizer=optimizer)
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "monitor": "val/acc", "interval": "epoch", "frequency": 1}}


class EmptyCheckpointHooks(ClassificationModule):
    def on_save_checkpoint(self, checkpoint) -> None:
        pass

    def on_load_checkpoint(self, checkpoint) -> None:
        pass


OVERRIDES = [EmptyTrainEpochEnd, EmptyValidationEpochEnd, EmptyTrainStart, EmptyFitStart, EmptyTrainEnd, EmptySetup,
             OwnSchedulerStep, OwnOptimizers, EmptyCheckpointHooks]


@pytest.mark.parametrize("owned_step", ["auto", False], ids=["owned-step", "lightning-step"])
@pytest.mark.parametrize("cls", OVERRIDES, ids=[c.__name__ for c in OVERRIDES])
def test_a_hook_overridden_without_super_keeps_the_plateau_schedule(cls, owned_step):
    """ReduceLROnPlateau on the validation metric halves the learning rate at each epoch's end after the first, as
    under Lightning's automatic optimization; the best-so-far metric is still logged."""
    module = build(cls, owned_step=owned_step)
    trainer = fit(module)
    assert module.automatic_optimization is (owned_step is False)
    assert lr_of(trainer) == EXPECTED_LR
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == EPOCHS
    assert float(trainer.callback_metrics["val/acc_best"]) == float(module.val_acc_best.compute())


def test_a_plateau_scheduler_steps_as_under_lightnings_optimization_with_an_empty_epoch_end():
    """The reported case, against Lightning's automatic optimization run for run: the same learning rate and
    weights after every epoch."""
    owned, lightning = build(EmptyTrainEpochEnd), build(EmptyTrainEpochEnd, owned_step=False)
    trainers = fit(owned), fit(lightning)
    assert lr_of(trainers[0]) == lr_of(trainers[1]) == EXPECTED_LR
    a, b = weights(owned), weights(lightning)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_resume_across_modes_works_with_the_checkpoint_hooks_overridden(tmp_path: Path):
    """Two epochs under Lightning's step, resumed for two more under the owned step: the step count carries over
    (the project's on_load_checkpoint work) and the run ends where an uninterrupted one does."""
    fit(build(EmptyCheckpointHooks, owned_step=False), epochs=2, callbacks=[LastCheckpoint(tmp_path / "a")])
    resumed = build(EmptyCheckpointHooks)
    trainer = fit(resumed, ckpt_path=str(tmp_path / "a" / "last.ckpt"), callbacks=[LastCheckpoint(tmp_path / "b")])
    whole = build(EmptyCheckpointHooks)
    whole_trainer = fit(whole, callbacks=[LastCheckpoint(tmp_path / "c")])
    assert trainer.global_step == whole_trainer.global_step == EPOCHS * 4
    assert lr_of(trainer) == lr_of(whole_trainer) == EXPECTED_LR
    a, b = weights(resumed), weights(whole)
    assert all(torch.equal(a[k], b[k]) for k in a)


class OwnCallbacksOnly(ClassificationModule):
    def configure_callbacks(self):
        return [Callback()]


def test_configure_callbacks_without_super_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^OwnCallbacksOnly.configure_callbacks leaves out StepMachinery.*; fix: "):
        fit(build(OwnCallbacksOnly), epochs=1)


class ExtraCallbacks(ClassificationModule):
    def configure_callbacks(self):
        return [*super().configure_callbacks(), Callback()]


def test_configure_callbacks_with_super_keeps_the_schedule():
    trainer = fit(build(ExtraCallbacks))
    assert lr_of(trainer) == EXPECTED_LR


class RecordingPlateau(torch.optim.lr_scheduler.ReduceLROnPlateau):
    """Records the metric value of each step."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.followed: list[float] = []

    def step(self, metrics, epoch=None) -> None:
        self.followed.append(float(metrics))
        super().step(metrics, epoch)


class FollowsAccuracy(ClassificationModule):
    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=LR)
        scheduler = RecordingPlateau(optimizer, mode="max", factor=0.5, patience=0)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "monitor": "val/acc"}}


def test_a_plateau_scheduler_follows_the_monitor_its_configure_optimizers_names():
    """Under the owned step too, the scheduler follows ``val/acc`` (as Lightning's optimization does), not the
    module's default ``scheduler_monitor`` (val/loss)."""
    followed = []
    for owned_step in ("auto", False):
        module = build(FollowsAccuracy, owned_step=owned_step)
        trainer = fit(module)
        assert module.automatic_optimization is (owned_step is False)
        followed.append(trainer.lr_scheduler_configs[0].scheduler.followed)
    assert len(followed[0]) == EPOCHS and followed[0] == followed[1]
    assert all(0 <= value <= 1 for value in followed[0]), "it followed the loss"


@pytest.fixture
def matmul_precision():
    saved = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(saved)


def test_an_empty_setup_keeps_the_projects_setup(matmul_precision):
    torch.set_float32_matmul_precision("highest")
    fit(build(EmptySetup, float32_matmul_precision="medium"), epochs=1)
    assert torch.get_float32_matmul_precision() == "medium"


def test_an_empty_on_fit_start_keeps_the_per_rank_random_stream():
    from src.engine.utils.seeding import rank_seed

    fit(build(EmptyFitStart), epochs=1)  # build seeds 0
    assert torch.initial_seed() == rank_seed(0, 0, "model")


@pytest.mark.parametrize("cls", [EmptyTrainStart, EmptyTrainEnd], ids=lambda c: c.__name__)
def test_empty_train_start_and_end_keep_the_captured_step(monkeypatch, cls):
    from src.engine.steps import step_capture
    from tests.helpers.recorded_graph import RecordedGraph

    monkeypatch.setitem(step_capture.GRAPHS, "cpu", RecordedGraph)
    module = build(cls, scheduler=None)
    trainer = fit(module, epochs=1)
    assert module.step_capture_counts == (1, trainer.global_step - step_capture.WARMUP_STEPS)
