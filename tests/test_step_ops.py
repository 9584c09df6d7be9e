"""A steady training step: no operation that makes a GPU's host wait, and no more operations than a plain loop.

On a GPU a small model's step is launch-bound, so every extra operation is host time, and a host-device
sync stalls the queue. Both are counted on the CPU with a ``TorchDispatchMode`` (tests/helpers/op_count.py),
over steady steps of the default run with its defaults on (progress bar, logging, checkpoints, callbacks).
The GPU twin, under ``torch.cuda.set_sync_debug_mode("error")``, is in tests/test_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from scripts.bench.plain_loop import in_memory_batches, normalize
from src.models.components.mlp import MLP
from tests.helpers.op_count import HOST_SYNC_OPS, OpCount, StepOpCount

COUNTER = ["+callbacks.op_count._target_=tests.helpers.op_count.StepOpCount", "++trainer.limit_train_batches=40",
           "test=false"]
# Lightning's own per-step additions, which no template on Lightning can drop: its closure divides the loss by
# the accumulation count (a division, and its backward) and clones it for the progress bar.
LIGHTNING_OPS = 3


def plain_ops_per_step(steps: int = 20) -> tuple[float, OpCount]:
    """The bench's plain loop step on the same work (normalized data, MLP, fused Adam, tensor-side sums)."""
    torch.manual_seed(0)
    x, y = normalize(torch.randint(0, 256, (2048, 1, 28, 28), dtype=torch.uint8)), torch.randint(0, 10, (2048,))
    net = MLP()
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3, fused=True)
    loss_sum, correct = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.long)
    batches = in_memory_batches(x, y, 64, shuffle=True, drop_last=True)
    mode = OpCount()
    for step, (xb, yb) in enumerate(batches):
        if step == 5:
            mode.__enter__()
        out = net(xb)
        loss = F.cross_entropy(out, yb)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss_sum += loss.detach().double() * len(yb)
        correct += (out.detach().argmax(1) == yb).sum()
        if step == 5 + steps:
            mode.__exit__(None, None, None)
            break
    return sum(mode.counts.values()) / steps, mode


def project_count(make_cfg, *overrides: str) -> StepOpCount:
    from src.train import train

    _, objects = train(make_cfg("train", [*COUNTER, *overrides]))
    counter = next(cb for cb in objects["callbacks"] if isinstance(cb, StepOpCount))
    assert counter.per_step is not None, "the counted window did not end"
    return counter


@pytest.mark.fast
def test_steady_steps_never_read_a_device_value(make_cfg):
    """No .item()/float()/bool(), no data-dependent shape: on a GPU each would stall the host every step."""
    counter = project_count(make_cfg, "data.augment=true")
    assert counter.mode.host_syncs == {}, counter.mode.host_syncs
    assert not HOST_SYNC_OPS & set(plain_ops_per_step()[1].counts)  # the counter sees them: the plain loop has none


@pytest.mark.fast
def test_a_step_dispatches_no_more_operations_than_a_plain_loop(make_cfg):
    """The whole step (fetch, transform, forward, backward, optimizer, metrics, every callback): the plain loop's
    operations plus Lightning's own, and at most the two metric counts on top."""
    project = project_count(make_cfg).per_step
    plain, _ = plain_ops_per_step()
    assert project <= plain + LIGHTNING_OPS + 2, (project, plain)
