"""A sample-weighted running mean that never syncs the host during updates."""

from __future__ import annotations

import torch
from torch import Tensor
from torchmetrics import Metric


class SampleMean(Metric):
    """Mean of per-batch mean values, weighted by each batch's sample count; exact across ranks.

    Why not ``torchmetrics.MeanMetric``: its NaN checks call ``.any()`` on every update (a
    host sync per step on GPU), and with ``nan_strategy="disable"`` (torchmetrics 1.9) it
    drops the ``weight`` argument and silently returns an unweighted mean of batch means.
    Here both sums are states reduced with ``sum`` at ``compute()``, so the distributed
    result is ``sum(loss_i * n_i) / sum(n_i)`` over every batch of every rank.
    """

    full_state_update = False
    higher_is_better = None

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("total", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, batch_mean: Tensor, num_samples: int) -> None:
        self.total += batch_mean.detach().to(torch.float64) * num_samples
        self.count += num_samples

    def compute(self) -> Tensor:
        return (self.total / self.count).to(torch.float32)
