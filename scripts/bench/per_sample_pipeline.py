"""The classic per-sample input pipeline (as in ashleve/lightning-hydra-template's MNIST datamodule).

``torchvision.datasets.FashionMNIST`` turns each image into a PIL image, ``ToTensor`` and
``Normalize`` run once per sample, and the DataLoader's default collate stacks the samples into a
batch. It reads the same IDX files as the project, so the only difference is how batches are made.
torchvision is imported when a dataset is built, so importing the constants here costs nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from torch.utils.data import DataLoader, Subset

if TYPE_CHECKING:
    from torchvision import datasets

FASHION_MEAN, FASHION_STD = (0.2860,), (0.3530,)


def per_sample_dataset(data_dir: str, train: bool) -> datasets.FashionMNIST:
    """Fashion-MNIST with per-sample ``ToTensor`` + ``Normalize`` (files must already be in ``data_dir``)."""
    from torchvision import datasets, transforms

    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize(FASHION_MEAN, FASHION_STD)])
    return datasets.FashionMNIST(data_dir, train=train, transform=transform, download=False)


def per_sample_loader(
    data_dir: str, train: bool, indices: Sequence[int] | None, batch_size: int, num_workers: int, shuffle: bool,
    pin_memory: bool = False,
) -> DataLoader:
    """A DataLoader over (a subset of) the per-sample dataset with the default collate (``pin_memory``: for a GPU)."""
    dataset = per_sample_dataset(data_dir, train)
    if indices is not None:
        dataset = Subset(dataset, list(indices))
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        drop_last=shuffle,  # training drops the last incomplete batch, like the project
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        pin_memory=pin_memory,
    )
