"""A dataset held as tensors that hands the DataLoader a whole batch per fetch."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.utils.data import Dataset


class InMemoryDataset(Dataset):
    """``(inputs[i], targets[i])`` pairs backed by two tensors.

    ``__getitems__`` (used by torch's DataLoader when present) gathers a batch with one
    indexing op instead of N ``__getitem__`` calls plus a collate, which is what makes
    the per-sample PIL pipeline slower than the model on small images. Samplers still
    choose the indices: a host list (copied to the data's device per batch), or an int64
    tensor already on that device (the resumable loader's ``index_device`` path).
    """

    def __init__(self, inputs: Tensor, targets: Tensor) -> None:
        if len(inputs) != len(targets):
            raise ValueError(f"inputs ({len(inputs)}) and targets ({len(targets)}) differ in length")
        self.inputs = inputs
        self.targets = targets

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        return self.inputs[index], self.targets[index]

    def __getitems__(self, indices: Sequence[int] | Tensor) -> tuple[Tensor, Tensor]:
        idx = torch.as_tensor(indices, dtype=torch.long)  # an index tensor cut on the device is used as it is
        if self.inputs.is_cuda and not idx.is_cuda:  # from pinned memory the copy is queued, not waited for: no sync
            idx = idx.pin_memory().to(self.inputs.device, non_blocking=True)
        # index_select copies whole rows; advanced indexing (inputs[idx]) is much slower on uint8 images.
        return self.inputs.index_select(0, idx), self.targets.index_select(0, idx)

    @property
    def nbytes(self) -> int:
        return self.inputs.nbytes + self.targets.nbytes


def keep_batch(batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """Collate function for :class:`InMemoryDataset`: the batch is already stacked."""
    return batch
