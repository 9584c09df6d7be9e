"""A GAN-like module: a generator and a discriminator, two optimizers, Lightning's manual optimization.

The data are points of a fixed 2-D Gaussian; the generator maps noise to points, the discriminator tells
the two apart. It logs plain floats with ``sync_dist=True``, as many users' modules do.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning import LightningDataModule, LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class TwoOptimizerGAN(LightningModule):
    def __init__(self, noise_dim: int = 4, hidden: int = 16, lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(noise_dim, hidden), nn.ReLU(), nn.Linear(hidden, 2))
        self.discriminator = nn.Sequential(nn.Linear(2, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        self.example_input_array = torch.zeros(2, noise_dim)

    def forward(self, noise: torch.Tensor) -> torch.Tensor:
        return self.generator(noise)

    def losses(self, real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        noise = torch.randn(real.shape[0], self.hparams.noise_dim, device=real.device)
        fake = self.generator(noise)
        bce = nn.functional.binary_cross_entropy_with_logits
        ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)
        d_loss = bce(self.discriminator(real), ones) + bce(self.discriminator(fake.detach()), zeros)
        g_loss = bce(self.discriminator(fake), ones)
        return d_loss, g_loss

    def training_step(self, batch: Any, batch_idx: int) -> None:
        (real,) = batch
        opt_g, opt_d = self.optimizers()
        d_loss, _ = self.losses(real)
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        _, g_loss = self.losses(real)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.log_dict({"train/d_loss": d_loss.detach(), "train/g_loss": g_loss.detach()}, prog_bar=True,
                      on_step=False, on_epoch=True, sync_dist=True)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        d_loss, g_loss = self.losses(batch[0])
        self.log_dict({"val/d_loss": d_loss, "val/g_loss": g_loss}, sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        d_loss, g_loss = self.losses(batch[0])
        self.log_dict({"test/d_loss": d_loss, "test/g_loss": g_loss}, sync_dist=True)

    def configure_optimizers(self) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
        return (torch.optim.Adam(self.generator.parameters(), lr=self.hparams.lr),
                torch.optim.Adam(self.discriminator.parameters(), lr=self.hparams.lr))


class GaussianPoints(LightningDataModule):
    def __init__(self, n: int = 512, batch_size: int = 32) -> None:
        super().__init__()
        self.save_hyperparameters()
        g = torch.Generator().manual_seed(0)
        points = torch.randn(n, 2, generator=g) * 0.5 + torch.tensor([2.0, -1.0])
        self.splits = {name: TensorDataset(part) for name, part in
                       zip(("train", "val", "test"), points.split([n // 2, n // 4, n // 4]), strict=True)}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.splits["train"], batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.splits["val"], batch_size=self.hparams.batch_size)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.splits["test"], batch_size=self.hparams.batch_size)
