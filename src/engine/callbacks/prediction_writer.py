"""Write ``predictions.csv``: one row per input, in input order, from every rank's share.

Each rank predicts an unpadded shard of the inputs (:meth:`InMemoryDataModule.eval_loader`), keeps its
rows with their input indices (Lightning's ``BasePredictionWriter`` passes them), and saves them; rank 0
merges the shards by index after a barrier, so the file is the same for any number of ranks.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any

import torch
from lightning import LightningModule, Trainer
from lightning.pytorch.callbacks import BasePredictionWriter

from src.engine.data.predict_inputs import NO_LABEL
from src.engine.utils.pylogger import RankedLogger

log = RankedLogger(__name__)


def first_of_each(index: torch.Tensor) -> torch.Tensor:
    """Positions that put ``index`` in ascending order, keeping each value's first occurrence only."""
    order = index.argsort(stable=True)
    keep = torch.ones(len(order), dtype=torch.bool)
    keep[1:] = index[order][1:] != index[order][:-1]
    return order[keep]


class PredictionWriter(BasePredictionWriter):
    """``classification``: columns ``source, predicted, label, p_0 .. p_{K-1}``; otherwise ``source, label,
    out_0 ..``. ``accuracy`` holds the share of correct predictions when every input has a label."""

    def __init__(self, path: str | Path, sources: list[str], classification: bool) -> None:
        super().__init__(write_interval="batch")
        self.path, self.sources, self.classification = Path(path), sources, classification
        self.rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.accuracy: float | None = None

    def write_on_batch_end(self, trainer: Trainer, pl_module: LightningModule, prediction: Any, batch_indices: Any,
                           batch: Any, batch_idx: int, dataloader_idx: int) -> None:
        labels = batch[1] if isinstance(batch, (list, tuple)) and len(batch) > 1 else None
        if not (isinstance(labels, torch.Tensor) and labels.dim() == 1 and len(labels) == len(prediction)):
            labels = torch.full((len(prediction),), NO_LABEL, dtype=torch.long)  # unlabelled inputs
        self.rows.append((torch.as_tensor(batch_indices), prediction.float().cpu(), labels.cpu()))

    def on_predict_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        shard = self.path.with_name(f"{self.path.stem}.rank{trainer.global_rank}.pt")
        torch.save([tuple(torch.cat(part) for part in zip(*self.rows, strict=True))] if self.rows else [], shard)
        trainer.strategy.barrier("prediction shards saved")
        if trainer.is_global_zero:
            self._merge([self.path.with_name(f"{self.path.stem}.rank{r}.pt") for r in range(trainer.world_size)])
        trainer.strategy.barrier("predictions written")

    def _merge(self, shards: list[Path]) -> None:
        parts = [part for shard in shards for part in torch.load(shard, weights_only=True)]
        for shard in shards:
            shard.unlink()
        index = torch.cat([p[0] for p in parts])
        order = first_of_each(index)  # Lightning's sampler pads a user's loader under DDP: an input twice
        outputs, labels = torch.cat([p[1] for p in parts])[order], torch.cat([p[2] for p in parts])[order]
        assert torch.equal(index[order], torch.arange(len(self.sources))), "every input predicted exactly once"
        width = outputs.shape[1] if outputs.dim() > 1 else 1
        outputs = outputs.reshape(len(outputs), width)
        head = ["source", "predicted", "label", *(f"p_{k}" for k in range(width))] if self.classification else \
            ["source", "label", *(f"out_{k}" for k in range(width))]
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w", newline="") as f:
            out = csv.writer(f)
            out.writerow(head)
            for source, row, label in zip(self.sources, outputs.tolist(), labels.tolist(), strict=True):
                shown = "" if label == NO_LABEL else label
                values = [f"{v:.6g}" for v in row]
                out.writerow([source, max(range(width), key=row.__getitem__), shown, *values]
                             if self.classification else [source, shown, *values])
        os.replace(tmp, self.path)
        if self.classification and bool((labels != NO_LABEL).all()):
            self.accuracy = float((outputs.argmax(1) == labels).float().mean())
            log.info(f"accuracy on these inputs: {self.accuracy:.4f} ({len(labels)} labelled)")
        log.info(f"predictions for {len(self.sources)} inputs: {self.path}")
