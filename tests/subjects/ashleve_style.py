"""A classifier and a data module in the style of ashleve's template (written here, not copied).

The module saves its ``net`` and its optimizer and scheduler partials as hyper-parameters, steps a
``ReduceLROnPlateau`` on ``val/loss``, keeps empty epoch-end hooks, and logs torchmetrics objects. The data
module wraps a torchvision dataset in ordinary ``DataLoader``\\ s (``shuffle=True``, worker processes) and
saves its list arguments, which Hydra hands over as ``ListConfig``.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning import LightningDataModule, LightningModule
from torch import nn
from torch.utils.data import ConcatDataset, DataLoader, Dataset, random_split
from torchmetrics import MaxMetric, MeanMetric
from torchmetrics.classification import Accuracy
from torchvision import datasets, transforms


class DenseNet(nn.Module):
    """Flatten, then linear layers with batch norm: a network that is not an ``nn.Sequential`` itself."""

    def __init__(self, input_size: int = 784, hidden: int = 64, output_size: int = 10) -> None:
        super().__init__()
        self.model = nn.Sequential(
            nn.Linear(input_size, hidden), nn.BatchNorm1d(hidden), nn.ReLU(),
            nn.Linear(hidden, hidden), nn.BatchNorm1d(hidden), nn.ReLU(),
            nn.Linear(hidden, output_size),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x.view(x.size(0), -1))


class LitClassifier(LightningModule):
    def __init__(self, net: nn.Module, optimizer: Any, scheduler: Any = None, compile: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters(logger=False)  # net and the partials go into the checkpoint's hparams
        self.net = net
        self.criterion = nn.CrossEntropyLoss()
        self.train_acc, self.val_acc, self.test_acc = (Accuracy(task="multiclass", num_classes=10) for _ in range(3))
        self.train_loss, self.val_loss, self.test_loss = MeanMetric(), MeanMetric(), MeanMetric()
        self.val_acc_best = MaxMetric()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def on_train_start(self) -> None:
        self.val_loss.reset()
        self.val_acc.reset()
        self.val_acc_best.reset()

    def model_step(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, y = batch
        logits = self.forward(x)
        return self.criterion(logits, y), logits.argmax(dim=1), y

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss, preds, targets = self.model_step(batch)
        self.train_loss(loss)
        self.train_acc(preds, targets)
        self.log("train/loss", self.train_loss, on_step=False, on_epoch=True, prog_bar=True)
        self.log("train/acc", self.train_acc, on_step=False, on_epoch=True, prog_bar=True)
        return loss

    def on_train_epoch_end(self) -> None:
        pass

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        loss, preds, targets = self.model_step(batch)
        self.val_loss(loss)
        self.val_acc(preds, targets)
        self.log("val/loss", self.val_loss, on_step=False, on_epoch=True, prog_bar=True)
        self.log("val/acc", self.val_acc, on_step=False, on_epoch=True, prog_bar=True)

    def on_validation_epoch_end(self) -> None:
        self.val_acc_best(self.val_acc.compute())
        self.log("val/acc_best", self.val_acc_best.compute(), sync_dist=True, prog_bar=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        loss, preds, targets = self.model_step(batch)
        self.test_loss(loss)
        self.test_acc(preds, targets)
        self.log("test/loss", self.test_loss, on_step=False, on_epoch=True, prog_bar=True)
        self.log("test/acc", self.test_acc, on_step=False, on_epoch=True, prog_bar=True)

    def on_test_epoch_end(self) -> None:
        pass

    def setup(self, stage: str) -> None:
        if self.hparams.compile and stage == "fit":
            self.net = torch.compile(self.net)

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = self.hparams.optimizer(params=self.trainer.model.parameters())
        if self.hparams.scheduler is None:
            return {"optimizer": optimizer}
        scheduler = self.hparams.scheduler(optimizer=optimizer)
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "monitor": "val/loss", "interval": "epoch", "frequency": 1}}


class FashionMNISTData(LightningDataModule):
    """torchvision's FashionMNIST (train and test joined, then split), in ordinary DataLoaders."""

    def __init__(self, data_dir: str = "data/", train_val_test_split: tuple[int, int, int] = (55_000, 5_000, 10_000),
                 batch_size: int = 64, num_workers: int = 0, pin_memory: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters(logger=False)  # a list from Hydra arrives as ListConfig
        self.transforms = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.2860,), (0.3530,))])
        self.data_train: Dataset | None = None
        self.data_val: Dataset | None = None
        self.data_test: Dataset | None = None
        self.batch_size_per_device = batch_size

    @property
    def num_classes(self) -> int:
        return 10

    def prepare_data(self) -> None:
        datasets.FashionMNIST(self.hparams.data_dir, train=True, download=True)
        datasets.FashionMNIST(self.hparams.data_dir, train=False, download=True)

    def setup(self, stage: str | None = None) -> None:
        if self.trainer is not None:
            self.batch_size_per_device = self.hparams.batch_size // self.trainer.world_size
        if not self.data_train and not self.data_val and not self.data_test:
            train = datasets.FashionMNIST(self.hparams.data_dir, train=True, transform=self.transforms)
            test = datasets.FashionMNIST(self.hparams.data_dir, train=False, transform=self.transforms)
            self.data_train, self.data_val, self.data_test = random_split(
                ConcatDataset([train, test]), [*self.hparams.train_val_test_split],
                generator=torch.Generator().manual_seed(42))

    def loader(self, dataset: Dataset, shuffle: bool) -> DataLoader:
        return DataLoader(dataset, batch_size=self.batch_size_per_device, num_workers=self.hparams.num_workers,
                          pin_memory=self.hparams.pin_memory, shuffle=shuffle)

    def train_dataloader(self) -> DataLoader:
        return self.loader(self.data_train, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self.loader(self.data_val, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self.loader(self.data_test, shuffle=False)
