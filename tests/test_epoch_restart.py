"""Resuming twice through a checkpoint taken on an epoch's last batch: Lightning 2.6 then repeats an epoch.

The first resume (from the last-batch checkpoint) keeps a stale restart stage for the next epoch,
so that epoch is never counted as started; a checkpoint saved in it is read by a second resume as
"epoch finished", and the epoch runs again. ``EpochRestartFix`` ends the stage at ``on_train_start``.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from src.engine.checkpointing.epoch_restart import EpochRestartFix

pytestmark = pytest.mark.fast

BATCHES, EPOCHS = 4, 3


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(BATCHES * 2, 2, generator=g), torch.randn(BATCHES * 2, 1, generator=g)),
                          batch_size=2)


class EpochStarts(Callback):
    def __init__(self) -> None:
        self.epochs: list[int] = []

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self.epochs.append(trainer.current_epoch)


def fit(root: Path, ckpt_path: Path | None, fix: bool) -> tuple[L.Trainer, EpochStarts]:
    starts = EpochStarts()
    every_step = ModelCheckpoint(dirpath=root, filename="{step}", every_n_train_steps=1, save_top_k=-1)
    trainer = L.Trainer(max_epochs=EPOCHS, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[every_step, starts, *([EpochRestartFix()] if fix else [])])
    trainer.fit(Tiny(), ckpt_path=ckpt_path)
    return trainer, starts


def resume_twice(tmp_path: Path, fix: bool) -> tuple[int, list[int]]:
    fit(tmp_path / "a", None, fix)
    last_batch_of_epoch_0 = tmp_path / "a" / f"step={BATCHES}.ckpt"
    _, starts = fit(tmp_path / "b", last_batch_of_epoch_0, fix)
    mid_epoch_1 = tmp_path / "b" / f"step={BATCHES + 2}.ckpt"
    trainer, _ = fit(tmp_path / "c", mid_epoch_1, fix)
    return trainer.global_step, starts.epochs


def test_second_resume_continues_where_the_first_one_was(tmp_path):
    steps, epoch_starts = resume_twice(tmp_path, fix=True)
    assert steps == BATCHES * EPOCHS
    assert epoch_starts == [1, 2], "on_train_epoch_start must run for every epoch after the resumed one"


def test_without_the_fix_lightning_repeats_an_epoch(tmp_path):
    """Proves the test above can fail: Lightning alone runs more steps than max_epochs allows."""
    steps, epoch_starts = resume_twice(tmp_path, fix=False)
    assert steps == BATCHES * EPOCHS + 2  # the two steps of epoch 1 before the second resume, run again
    assert epoch_starts == [2]
