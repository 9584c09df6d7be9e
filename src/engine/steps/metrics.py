"""Sample-weighted metrics that never sync the host during updates, in as few device ops as possible.

A training step on a GPU is launch-bound for small models: every kernel a metric launches per step
counts. Both metrics keep sums and counts as states reduced with ``sum``, so the distributed result is
the exact mean over every sample of every rank.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torchmetrics import Metric


class SampleMean(Metric):
    """Mean of per-batch mean values, weighted by each batch's sample count; exact across ranks.

    Why not ``torchmetrics.MeanMetric``: its NaN checks call ``.any()`` on every update (a host sync per
    step on GPU), and with ``nan_strategy="disable"`` (torchmetrics 1.9) it drops the ``weight`` argument
    and silently returns an unweighted mean of batch means. Here ``sum(loss_i * n_i) / sum(n_i)``.
    """

    full_state_update = False
    higher_is_better = None

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("total", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, batch_mean: Tensor, num_samples: int) -> None:
        self.total.add_(batch_mean, alpha=num_samples)  # one kernel, in float64 (torchmetrics updates without grad)
        self.count += num_samples

    def compute(self) -> Tensor:
        return (self.total / self.count).to(torch.float32)


class SampleAccuracy(Metric):
    """Top-1 accuracy from class scores: correct predictions over samples, exact across ranks.

    Why not torchmetrics' ``MulticlassAccuracy(average="micro")``: it updates four statistics (tp, fp, tn,
    fn) from separate reductions, about three times the kernels of counting ``argmax == target``, on
    every training step. The value is the same: correct / samples.
    """

    full_state_update = False
    higher_is_better = True

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("correct", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, scores: Tensor, target: Tensor) -> None:
        self.correct += (scores.argmax(dim=1) == target).sum()
        self.count += target.numel()

    def compute(self) -> Tensor:
        return self.correct.to(torch.float32) / self.count
