"""``last.ckpt`` is the final state of every fit and every epoch, whatever the monitored metric did and
whatever ``callbacks`` holds: what a requeue resumes and what eval and export read."""

from __future__ import annotations

import csv
import os
import shutil
import signal
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.utils.data import DataLoader, TensorDataset

from src.engine.checkpointing.last_checkpoint import LastCheckpoint
from src.engine.data.resumable_loader import GlobalBatchShuffle, ResumableDataLoader
from src.train import train

pytestmark = pytest.mark.fast  # in-process toy fits, about a second each


@pytest.mark.parametrize("callbacks", ["default", "none"])
def test_last_ckpt_holds_the_weights_in_memory_when_fit_ends_between_intervals(make_cfg, callbacks):
    # 2 epochs of 10 steps, last.ckpt every 7: a fit ending at step 12 saved at 7 and 10 on the way
    cfg = make_cfg("train", ["model=toy", "data=toy", f"callbacks={callbacks}", "last_ckpt_every_n_train_steps=7",
                             "++trainer.limit_train_batches=10", "trainer.max_epochs=3", "+trainer.max_steps=12",
                             "test=false"])
    _, objects = train(cfg)
    trainer, model = objects["trainer"], objects["model"]
    assert trainer.global_step == 12
    (owner,) = [cb for cb in trainer.callbacks if isinstance(cb, LastCheckpoint)]
    saved = torch.load(owner.path, weights_only=False)
    assert saved["global_step"] == 12
    memory = model.state_dict()
    assert saved["state_dict"].keys() == memory.keys()
    assert all(torch.equal(saved["state_dict"][k], memory[k]) for k in memory)


@pytest.mark.parametrize("model", ["toy", "mlp"])
def test_max_steps_shorter_than_an_epoch_validates_its_last_step(make_cfg, model):
    """``max_steps`` before any validation: no early-stopping error; the last step is validated, the best
    checkpoint and ``last.ckpt`` hold it."""
    data = ["data=toy"] if model == "toy" else []
    cfg = make_cfg("train", [f"model={model}", *data, "++trainer.limit_train_batches=10", "trainer.max_epochs=2",
                             "+trainer.max_steps=4", "test=false"])
    metrics, objects = train(cfg)
    trainer = objects["trainer"]
    assert trainer.global_step == 4  # of 10 steps in the first epoch
    monitored = trainer.early_stopping_callback.monitor
    assert monitored in metrics and trainer.early_stopping_callback.wait_count == 0
    best = torch.load(trainer.checkpoint_callback.best_model_path, weights_only=True)
    assert best["global_step"] == 4
    (owner,) = [cb for cb in trainer.callbacks if isinstance(cb, LastCheckpoint)]
    assert torch.load(owner.path, weights_only=True)["global_step"] == 4


def test_max_time_mid_epoch_validates_and_saves_its_last_step(make_cfg):
    """``max_time`` (Lightning's Timer) stops a run, mid-epoch as a rule: the last step is validated (its
    validation row is logged), ``last.ckpt`` holds it, and early stopping has its metric."""
    cfg = make_cfg("train", ["model=toy", "data=toy", "trainer.max_epochs=1000", "+trainer.max_time=00:00:00:02",
                             "test=false", "callbacks.early_stopping.patience=10000"])
    metrics, objects = train(cfg)
    trainer = objects["trainer"]
    assert 0 < trainer.global_step < 1000 * trainer.num_training_batches  # the timer, not max_epochs, ended it
    assert trainer.early_stopping_callback.monitor in metrics
    (owner,) = [cb for cb in trainer.callbacks if isinstance(cb, LastCheckpoint)]
    assert torch.load(owner.path, weights_only=True)["global_step"] == trainer.global_step
    (log,) = Path(cfg.paths.output_dir).rglob("metrics.csv")
    validated = [int(row["step"]) for row in csv.DictReader(log.open()) if row.get("val/loss")]
    assert validated[-1] == trainer.global_step - 1, (validated[-3:], trainer.global_step)  # logged at the step's index


class _Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def _data(self) -> TensorDataset:
        g = torch.Generator().manual_seed(0)
        return TensorDataset(torch.randn(16, 2, generator=g), torch.randn(16, 1, generator=g))

    def train_dataloader(self) -> DataLoader:  # keeps its position: last.ckpt is saved mid-epoch too
        data = self._data()
        return ResumableDataLoader(data, batch_size=2, sampler=GlobalBatchShuffle(data, seed=0, global_batch=2))

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self._data(), batch_size=2)


class _Validations(Callback):
    def __init__(self) -> None:
        self.count = 0

    def on_validation_end(self, trainer, pl_module) -> None:
        self.count += not trainer.sanity_checking


class _KeepEverySave(LastCheckpoint):
    """Keeps a copy of each ``last.ckpt`` it writes, with how many validations had run by then."""

    def __init__(self, dirpath: Path, validations: _Validations) -> None:
        super().__init__(dirpath, every_n_train_steps=4)
        self.kept: list[tuple[Path, int]] = []
        self._validations = validations

    def save(self, trainer, final: bool = False) -> None:
        step = self._saved_step
        super().save(trainer, final)
        if self._saved_step != step or final:
            copy = self.path.with_name(f"save_{len(self.kept)}.ckpt")
            shutil.copy(self.path, copy)
            self.kept.append((copy, self._validations.count))


def _fit(root: Path, ckpt_path: Path | None = None) -> tuple[_Validations, _KeepEverySave]:
    validations = _Validations()
    keep = _KeepEverySave(root / "checkpoints", validations)
    trainer = L.Trainer(max_epochs=2, val_check_interval=4, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[keep, validations])
    trainer.fit(_Tiny(), ckpt_path=ckpt_path)
    return validations, keep


def test_a_resume_from_any_last_ckpt_runs_every_validation_the_run_had_left(tmp_path):
    """8 batches an epoch, validation every 4, last.ckpt every 4 steps: each periodic save falls on a batch
    that a validation follows. Lightning skips a validation that was due at the batch a fit resumes from,
    so a save before it would lose it (its metrics, early stopping, a plateau scheduler's step): the save
    waits for it. Resumed from each ``last.ckpt`` the run wrote, the validations before and after add up."""
    validations, keep = _fit(tmp_path / "whole")
    assert validations.count == 4 and len(keep.kept) >= 4
    for i, (path, before) in enumerate(keep.kept):
        after, _ = _fit(tmp_path / f"resumed_{i}", ckpt_path=path)
        assert before + after.count == validations.count, (path.name, before, after.count)


def _rows(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "csv" / "version_0" / "metrics.csv", newline="") as f:
        return [{k: v for k, v in row.items() if v and not k.startswith("perf/")} for row in csv.DictReader(f)]


def test_a_kill_just_after_any_last_ckpt_of_an_epoch_resumes_to_the_whole_runs_rows(make_cfg, tmp_path, monkeypatch):
    """Validation every 5 of 10 batches, last.ckpt every 5 steps. The run dir as a kill right after each of
    epoch 0's saves leaves it, resumed, ends with the uninterrupted run's rows:

    * step 5's save waits for the validation after it, and keeps the epoch's running training metrics: the
      resumed epoch logs its mean over all its batches;
    * the epoch's end: Lightning writes the epoch's training row after every epoch-end hook (last.ckpt is saved
      in one), and a fit resumed from an epoch's end never writes it, so it goes out before the save.
    """
    common = ["model=toy", "data=toy", "++trainer.limit_train_batches=10", "trainer.max_epochs=2", "test=false",
              "+trainer.val_check_interval=5", "last_ckpt_every_n_train_steps=5"]
    _, objects = train(make_cfg("train", common, subdir="whole"))
    whole = _rows(Path(objects["trainer"].default_root_dir))
    assert [row["step"] for row in whole if "val/loss" in row] == ["4", "9", "14", "19"]

    frozen, save = [], LastCheckpoint.save

    def save_then_freeze_the_run_dir(self, trainer, final=False):  # what a kill -9 just after this save leaves
        save(self, trainer, final)
        if trainer.current_epoch == 0:
            frozen.append(shutil.copytree(trainer.default_root_dir, tmp_path / f"killed_{len(frozen)}"))

    monkeypatch.setattr(LastCheckpoint, "save", save_then_freeze_the_run_dir)
    train(make_cfg("train", common, subdir="first"))
    monkeypatch.undo()
    assert [torch.load(d / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] for d in frozen] == [5, 10]
    for killed in frozen:
        train(make_cfg("train", [*common, f"ckpt_path={killed / 'checkpoints' / 'last.ckpt'}"], subdir=killed.name))
        assert _rows(killed) == whole, killed.name


class SigtermDuring(Callback):
    """Sends this process SIGTERM while training batch ``batch`` of epoch ``epoch`` runs."""

    def __init__(self, batch: int, epoch: int = 0) -> None:
        self.batch, self.epoch = batch, epoch

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.current_epoch == self.epoch and batch_idx == self.batch:
            os.kill(os.getpid(), signal.SIGTERM)


def _final_state(run_dir: Path) -> tuple[int, dict, list[dict[str, str]]]:
    saved = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)
    return saved["global_step"], saved["state_dict"], _rows(run_dir)


TEN_BATCHES = ["model=toy", "data=toy", "++trainer.limit_train_batches=10", "test=false",
               "last_ckpt_every_n_train_steps=1000"]
HALVES = "model.scheduler={_target_:torch.optim.lr_scheduler.ReduceLROnPlateau,_partial_:true,factor:0.5,patience:0,threshold:100,threshold_mode:abs}"


@pytest.mark.faults
@pytest.mark.parametrize(("overrides", "epoch", "batch", "saved_at"), [
    pytest.param(["+trainer.val_check_interval=5"], 0, 2, 3, id="nothing-follows"),
    pytest.param(["+trainer.val_check_interval=5"], 0, 4, 5, id="a-validation-follows"),
    pytest.param(["+trainer.val_check_interval=5"], 0, 9, 10, id="the-epochs-last-batch"),
    pytest.param(["+trainer.val_check_interval=5", "trainer.min_epochs=0",
                  "+callbacks.early_stopping.stopping_threshold=1e9"], 0, 4, 5, id="early-stopping-at-that-validation"),
    pytest.param(["+callbacks.early_stopping.stopping_threshold=1e9"], 0, 9, 10, id="early-stopping-at-the-epochs-end"),
    pytest.param(["+trainer.max_steps=7"], 0, 6, 7, id="the-max-steps-batch"),
    # early stopping fires at epoch 0's validation only (val/loss 10.44, then 10.28): min_epochs keeps the fit going
    pytest.param(["trainer.min_epochs=2", "+callbacks.early_stopping.divergence_threshold=10.35"], 0, 9, 10,
                 id="early-stopping-before-min-epochs"),
    pytest.param(["trainer.min_epochs=2", "+trainer.val_check_interval=1",
                  "+callbacks.early_stopping.stopping_threshold=1e9",
                  "+callbacks.early_stopping.check_on_train_epoch_end=false"], 0, 4, 5,
                 id="early-stopping-at-that-validation-before-min-epochs"),
    pytest.param([HALVES], 1, 2, 13, id="a-plateau-scheduler-mid-epoch"),
])
def test_a_one_process_sigterm_stop_resumes_to_the_uninterrupted_run(make_cfg, overrides, epoch, batch, saved_at):
    """SIGTERM during one batch (validation every 5 of 10 where set). The stop waits for a validation or the
    epoch's end that follows the batch (a save before them made the resume skip them); where early stopping or
    the max_steps stop ends the fit there, for the fit's final save (a resume from before it trained on). The
    stopped run, resumed in its own dir, ends with the uninterrupted run's step, weights and CSV rows (a
    plateau scheduler's step at the end of an epoch resumed mid-way included)."""
    common = [*TEN_BATCHES, "trainer.max_epochs=3", *overrides]
    _, objects = train(make_cfg("train", common, subdir="whole"))
    whole = _final_state(Path(objects["trainer"].default_root_dir))
    signalled = ["+callbacks.sigterm._target_=tests.test_last_checkpoint.SigtermDuring",
                 f"+callbacks.sigterm.batch={batch}", f"+callbacks.sigterm.epoch={epoch}"]
    cfg = make_cfg("train", [*common, *signalled], subdir="stopped")
    with pytest.raises((SIGTERMException, SystemExit)) as stop:
        train(cfg)
    assert stop.value.code == 128 + signal.SIGTERM
    run_dir = Path(cfg.paths.output_dir)
    last = run_dir / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=False)["global_step"] == saved_at
    train(make_cfg("train", [*common, f"ckpt_path={last}"], subdir="stopped"))
    step, weights, rows = _final_state(run_dir)
    assert step == whole[0]
    assert all(torch.equal(weights[k], whole[1][k]) for k in whole[1])
    assert rows == whole[2]


class _TinyWithoutValidationData(_Tiny):
    def val_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.zeros(0, 2), torch.zeros(0, 1)), batch_size=2)


def test_a_save_that_waited_for_a_validation_that_did_not_run_is_made_a_step_later(tmp_path):
    """An empty validation set: Lightning skips the validation due every 4 batches, so the save that waited
    for its end is made at the next step instead of being lost until the epoch's end."""
    validations = _Validations()
    keep = _KeepEverySave(tmp_path / "checkpoints", validations)
    trainer = L.Trainer(max_epochs=2, val_check_interval=4, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[keep, validations])
    trainer.fit(_TinyWithoutValidationData())
    steps = [torch.load(path, weights_only=False)["global_step"] for path, _ in keep.kept]
    assert validations.count == 0 and steps == [5, 8, 13, 16, 16]


@pytest.mark.faults
def test_a_stop_that_waited_for_a_validation_that_did_not_run_is_made_a_step_later(tmp_path):
    """An empty validation set due after every batch: the stop noted at batch 1 waits once, then is made (it
    waited for the epoch's end, 8 batches on, before)."""
    from src.engine.checkpointing.required import resume_callbacks

    trainer = L.Trainer(max_epochs=2, val_check_interval=1, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=tmp_path,
                        callbacks=[*resume_callbacks(tmp_path), SigtermDuring(batch=1)])
    with pytest.raises((SIGTERMException, SystemExit)):
        trainer.fit(_TinyWithoutValidationData())
    assert torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 3


@pytest.mark.parametrize("mine_first", [True, False])
def test_a_checkpoint_callback_after_last_checkpoint_is_named(tmp_path, caplog, mine_first):
    """A hand-built Trainer: a ModelCheckpoint after LastCheckpoint would miss the validation a stop is made at."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from src.engine.checkpointing.required import resume_callbacks

    mine = [ModelCheckpoint(dirpath=tmp_path / "best")]
    callbacks = [*mine, *resume_callbacks(tmp_path)] if mine_first else [*resume_callbacks(tmp_path), *mine]
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path, callbacks=callbacks)
    with caplog.at_level("WARNING"):
        trainer.fit(_Tiny())
    named = [r.getMessage() for r in caplog.records if "after LastCheckpoint" in r.getMessage()]
    if mine_first:
        assert not named
    else:
        assert len(named) == 1 and named[0].startswith("ModelCheckpoint"), named


@pytest.mark.faults
def test_an_early_stopped_fit_resumed_from_its_end_trains_on_only_under_a_larger_limit(make_cfg):
    """Lightning does not keep should_stop: resumed from the final last.ckpt, an early-stopped fit trained on to
    the next validation. Now it stops at once under the same limits, also with another save interval (the
    callback's state is found whatever its settings), and trains on under a larger max_epochs."""
    common = [*TEN_BATCHES[:-1], "+trainer.val_check_interval=5", "trainer.min_epochs=0",
              "+callbacks.early_stopping.stopping_threshold=1e9"]
    _, objects = train(make_cfg("train", [*common, "trainer.max_epochs=3", "last_ckpt_every_n_train_steps=1000"],
                                subdir="stopped"))
    assert objects["trainer"].global_step == 5  # early stopping, at the first validation
    last = Path(objects["trainer"].default_root_dir) / "checkpoints" / "last.ckpt"
    for limit, steps in [("trainer.max_epochs=3", 5), ("trainer.max_epochs=4", 10)]:
        _, resumed = train(make_cfg("train", [*common, limit, "last_ckpt_every_n_train_steps=7", f"ckpt_path={last}"],
                                    subdir=limit))
        assert resumed["trainer"].global_step == steps, limit


@pytest.mark.fast
def test_a_timers_max_time_is_read_to_the_millisecond_before_and_while_it_runs():
    """The max_time a last.ckpt notes (a resume under the same one stops where the fit would have), read from the
    Timer's public remaining + elapsed."""
    import time

    from lightning.pytorch.callbacks import Timer

    from src.engine.checkpointing.last_checkpoint import _max_time

    timer = Timer(duration="00:00:01:30")
    assert _max_time(timer) == 90.0
    timer.on_train_start(None, None)  # the clock starts
    time.sleep(0.05)
    assert timer.time_elapsed() > 0 and _max_time(timer) == 90.0
    assert _max_time(Timer(duration={"seconds": 2.5})) == 2.5
