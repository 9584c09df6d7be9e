"""A test-only callback: the bytes this rank holds for parameters, gradients and optimizer state, measured.

Each tensor is counted as this process holds it: a DTensor (an FSDP2 shard) by its local part
(``to_local()``), a plain tensor whole. ``remainder`` is what sharding cannot divide by the number of ranks:
plain tensors (e.g. Adam's step counters), and one row per sharded tensor (torch shards dim 0 in
``ceil(rows / N)`` pieces, so a shard may hold a row more than ``rows / N``). ``units`` counts the modules
that ``fully_shard`` made into FSDP units (0 under DDP; 1 when only a root was wrapped).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from lightning import Callback, LightningModule, Trainer
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor


def held(tensors: Iterable[torch.Tensor]) -> tuple[int, int, int]:
    """``(bytes held here, bytes of sharded tensors held here, remainder)`` over ``tensors``."""
    total = sharded = remainder = 0
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        size = local.numel() * local.element_size()
        total += size
        if isinstance(t, DTensor):
            sharded += size
            remainder += t.shape[1:].numel() * local.element_size()
        else:
            remainder += size
    return total, sharded, remainder


class ShardBytes(Callback):
    """At the end of training (gradients of the last step still held): ``self.measured[kind] = held(...)``."""

    def __init__(self) -> None:
        self.measured: dict[str, tuple[int, int, int]] = {}
        self.units = 0

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        params = [p for p in pl_module.parameters() if p.requires_grad]
        states = [v for opt in trainer.optimizers for s in opt.state.values() for v in s.values()
                  if isinstance(v, torch.Tensor)]
        self.measured = {"params": held(params), "grads": held(p.grad for p in params if p.grad is not None),
                         "optimizer": held(states)}
        self.units = sum(isinstance(m, FSDPModule) for m in pl_module.modules())
