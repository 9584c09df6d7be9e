"""``last.ckpt`` is the final state of every fit and every epoch, whatever the monitored metric did and
whatever ``callbacks`` holds: what a requeue resumes and what eval and export read."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from src.checkpointing.last_checkpoint import LastCheckpoint
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
