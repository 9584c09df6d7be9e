"""Move gradients the pipeline schedule produced past Lightning's ``zero_grad``, and average them over replicas.

Lightning's automatic optimisation runs ``training_step -> zero_grad -> backward`` inside
the optimizer closure. A pipeline schedule runs backward *inside* ``training_step``, so
its gradients would be wiped by the ``zero_grad`` that follows. The strategy therefore
takes the fresh gradients out of the parameters right after the schedule (putting back
whatever Lightning had accumulated before), and adds them back in its ``backward`` hook.
This is a pointer swap, not a copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn


def take_grads(params: Sequence[nn.Parameter]) -> list[Tensor | None]:
    """Detach every ``.grad`` from its parameter (leaving ``None``) and return them in order."""
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    return grads


def add_grads(params: Sequence[nn.Parameter], grads: Sequence[Tensor | None]) -> None:
    """Add ``grads`` into the parameters' ``.grad`` (setting it where it is ``None``)."""
    for p, g in zip(params, grads, strict=True):
        if g is None:
            continue
        if p.grad is None:
            p.grad = g
        else:
            p.grad.add_(g)


def reduce_grads(grads: Sequence[Tensor | None], group: dist.ProcessGroup | None, divisor: float) -> None:
    """Sum ``grads`` in place over ``group`` (the replicas of one stage; ``None``: no reduction), then divide.

    The reduction goes through one flat buffer, one collective instead of one per tensor
    (latency, not bandwidth, dominates at these sizes). SUM then divide: gloo has no AVG.
    """
    present = [g for g in grads if g is not None]
    if not present:
        return
    if group is None:
        if divisor != 1:
            for g in present:
                g.div_(divisor)
        return
    flat = torch.cat([g.reshape(-1) for g in present])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    flat.div_(divisor)
    offset = 0
    for g in present:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
