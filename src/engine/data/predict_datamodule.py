"""Data modules that serve prediction inputs through another data module's loaders and transforms."""

from __future__ import annotations

from typing import Any

from lightning import LightningDataModule
from torch.utils.data import DataLoader

from src.engine.data.in_memory import InMemoryDataset
from src.engine.data.in_memory_datamodule import InMemoryDataModule


class PredictDataModule(LightningDataModule):
    """``predict_dataloader`` over ``dataset``, batched, sharded without padding across ranks, and normalized
    on the device, all as ``source`` does for its test split; nothing to prepare or set up (the inputs are
    loaded already: :func:`src.engine.data.predict_inputs.load_inputs`)."""

    def __init__(self, source: InMemoryDataModule, dataset: InMemoryDataset) -> None:
        super().__init__()
        self.source, self.dataset = source, dataset

    def setup(self, stage: str) -> None:
        self.source.trainer = self.trainer  # its loaders shard by the trainer's world size

    def predict_dataloader(self) -> DataLoader:
        return self.source.eval_loader(self.dataset)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return self.source.on_after_batch_transfer(batch, dataloader_idx)


class SplitPredictDataModule(LightningDataModule):
    """``predict_dataloader``: the ``test`` (or ``predict``) loader of a data module that is not the project's,
    as that module builds it, with its batch transfer hooks; it is set up already (the inputs are counted)."""

    def __init__(self, source: LightningDataModule, split: str) -> None:
        super().__init__()
        self.source, self.split = source, split

    def predict_dataloader(self) -> Any:
        self.source.trainer = self.trainer
        return getattr(self.source, f"{self.split}_dataloader")()

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return self.source.on_before_batch_transfer(batch, dataloader_idx)

    def transfer_batch_to_device(self, batch: Any, device: Any, dataloader_idx: int) -> Any:
        return self.source.transfer_batch_to_device(batch, device, dataloader_idx)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return self.source.on_after_batch_transfer(batch, dataloader_idx)
