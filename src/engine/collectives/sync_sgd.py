"""Synchronous data-parallel SGD written by hand: shard the data, average gradients with all_reduce.

This is what DistributedDataParallel automates (it adds bucketing and overlap with the backward pass).
:func:`compare_with_ddp` runs both on the same batches and reports how far their gradients and weights
drift apart; they should agree to float rounding.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from src.engine.collectives.runtime import comm_device

__all__ = ["DataPartitioner", "Partition", "average_gradients", "compare_with_ddp", "partition_dataset",
           "shard_batch", "sync_sgd_weights", "toy_problem", "train_sync_sgd"]


class Partition(Dataset):
    """A view of ``data`` restricted to ``indices``."""

    def __init__(self, data: Sequence | Dataset, indices: Sequence[int]) -> None:
        self.data, self.indices = data, list(indices)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> Any:
        return self.data[self.indices[i]]


class DataPartitioner:
    """Shuffle indices once with a seeded generator, then cut them into disjoint slices of the given fractions.

    Every rank builds the same partitioner (same seed, same data length), so the slices agree across ranks
    without any communication.
    """

    def __init__(self, data: Sequence | Dataset, sizes: Sequence[float], seed: int = 1234) -> None:
        if any(s < 0 for s in sizes) or sum(sizes) > 1 + 1e-9:
            raise ValueError(f"partition fractions must be >= 0 and sum to at most 1, got {list(sizes)}")
        self.data = data
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed)).tolist()
        self.partitions: list[list[int]] = []
        start = 0
        for frac in sizes:
            length = int(frac * len(data))
            self.partitions.append(order[start:start + length])
            start += length

    def use(self, partition: int) -> Partition:
        return Partition(self.data, self.partitions[partition])


def partition_dataset(data: Sequence | Dataset, rank: int | None = None, world_size: int | None = None,
                      seed: int = 1234) -> Partition:
    """This rank's equal, disjoint shard (``len(data) // world_size`` items; the remainder is dropped)."""
    rank = dist.get_rank() if rank is None else rank
    world_size = dist.get_world_size() if world_size is None else world_size
    return DataPartitioner(data, [1.0 / world_size] * world_size, seed=seed).use(rank)


def average_gradients(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Replace every parameter gradient by its mean over ``group`` (all_reduce SUM, then divide).

    All reductions are launched before any is awaited, so they overlap with each other.
    """
    world_size = dist.get_world_size(group)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    works = [dist.all_reduce(g, op=dist.ReduceOp.SUM, group=group, async_op=True) for g in grads]
    for work, grad in zip(works, grads, strict=True):
        work.wait()
        grad.div_(world_size)


def toy_problem(seed: int, samples: int = 256, features: int = 10) -> tuple[TensorDataset, nn.Module]:
    """A regression data set and a small MLP, identical on every rank for the same seed."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, features, generator=gen)
    y = x @ torch.randn(features, 1, generator=gen) + 0.1 * torch.randn(samples, 1, generator=gen)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(features, 16), nn.Tanh(), nn.Linear(16, 1))
    return TensorDataset(x, y), model


def shard_batch(shard: Partition, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    items = [shard[(step * batch_size + j) % len(shard)] for j in range(batch_size)]
    return torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])


def train_sync_sgd(epochs: int = 3, batch_size: int = 16, lr: float = 0.05, seed: int = 0) -> list[float]:
    """Train the toy model with hand-written synchronous SGD; return the mean loss per epoch over all ranks."""
    device = comm_device()
    data, model = toy_problem(seed)
    model = model.to(device)
    shard = partition_dataset(data, seed=seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for _ in range(epochs):
        total = torch.zeros(2, device=device)
        for step in range(max(1, len(shard) // batch_size)):
            x, y = (t.to(device) for t in shard_batch(shard, step, batch_size))
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            average_gradients(model)
            opt.step()
            total += torch.tensor([loss.item(), 1.0], device=device)
        dist.all_reduce(total)
        losses.append((total[0] / total[1]).item())
    return losses


def sync_sgd_weights(steps: int = 8, batch_size: int = 16, lr: float = 0.05, seed: int = 0) -> dict[str, torch.Tensor]:
    """The toy model's weights after ``steps`` steps of hand-written synchronous SGD, one batch of each rank's
    shard per step: the reference that ``trainer=ps`` with ``max_staleness=0`` is checked against."""
    device = comm_device()
    data, model = toy_problem(seed)
    model = model.to(device)
    shard = partition_dataset(data, seed=seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        x, y = (t.to(device) for t in shard_batch(shard, step, batch_size))
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        average_gradients(model)
        opt.step()
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def compare_with_ddp(steps: int = 3, batch_size: int = 8, lr: float = 0.1, seed: int = 0) -> dict[str, float]:
    """Run hand-written sync SGD and DDP side by side on the same per-rank batches.

    Returns the largest absolute gradient difference seen over all steps and the largest weight difference
    after the last step, both maximised over ranks.
    """
    from torch.nn.parallel import DistributedDataParallel

    device = comm_device()
    data, model = toy_problem(seed)
    model = model.to(device)
    ddp = DistributedDataParallel(copy.deepcopy(model), device_ids=[device] if device.type == "cuda" else None)
    shard = partition_dataset(data, seed=seed)
    opt_hand = torch.optim.SGD(model.parameters(), lr=lr)
    opt_ddp = torch.optim.SGD(ddp.parameters(), lr=lr)
    grad_diff = 0.0
    for step in range(steps):
        x, y = (t.to(device) for t in shard_batch(shard, step, batch_size))
        for net, opt in ((model, opt_hand), (ddp, opt_ddp)):
            opt.zero_grad()
            nn.functional.mse_loss(net(x), y).backward()
        average_gradients(model)
        for p_hand, p_ddp in zip(model.parameters(), ddp.module.parameters(), strict=True):
            grad_diff = max(grad_diff, (p_hand.grad - p_ddp.grad).abs().max().item())
        opt_hand.step()
        opt_ddp.step()
    param_diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ddp.module.parameters(),
                                                                  strict=True))
    worst = torch.tensor([grad_diff, param_diff], dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return {"max_grad_diff": worst[0].item(), "max_param_diff": worst[1].item(), "steps": float(steps)}
