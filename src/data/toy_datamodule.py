"""Synthetic regression data for the toy model: random inputs, a fixed random linear teacher plus noise."""

from __future__ import annotations

import torch
from torch import Tensor

from src.engine import InMemoryDataModule


class ToyDataModule(InMemoryDataModule):
    """SYNTHETIC data, generated from ``seed``: ``y = x @ W + noise``. Losses on it say nothing about real tasks.

    Useful to exercise strategies in seconds. ``num_samples`` is the train+val pool;
    the test split has ``num_test`` samples drawn from the same teacher.
    """

    task = "regression"  # pairs with models of the same task (src/engine/utils/config_checks.py)

    def __init__(
        self,
        num_samples: int = 4096,
        num_test: int = 1024,
        in_features: int = 10,
        out_features: int = 5,
        noise: float = 0.1,
        batch_size: int = 64,
        val_size: int = 512,
        seed: int = 12345,
        on_device: bool | str = "auto",
        n_folds: int | None = None,
        fold: int = 0,
    ) -> None:
        super().__init__(data_dir="", batch_size=batch_size, val_size=val_size, seed=seed, on_device=on_device,
                         n_folds=n_folds, fold=fold)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return (self.hparams.in_features,)

    def load_split(self, train: bool) -> tuple[Tensor, Tensor]:
        hp = self.hparams
        gen = torch.Generator().manual_seed(hp.seed)
        teacher = torch.randn(hp.in_features, hp.out_features, generator=gen)
        if not train:  # advance the stream so test inputs differ from train inputs
            torch.randn(hp.num_samples, hp.in_features, generator=gen)
        n = hp.num_samples if train else hp.num_test
        x = torch.randn(n, hp.in_features, generator=gen)
        return x, x @ teacher + hp.noise * torch.randn(n, hp.out_features, generator=gen)
