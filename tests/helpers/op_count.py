"""Count the tensor operations a steady training step dispatches, and the ones that would stop a GPU's host.

On a GPU a small model's step is launch-bound: each operation costs host time whatever its size, so the
number of operations per step is what the project and a plain loop should be compared on, and it can be
counted on a CPU too. :class:`OpCount` is a ``TorchDispatchMode`` (below autograd: forward, backward and
optimizer operations all pass through it); :class:`StepOpCount` is a Lightning callback that counts every
operation between the ends of two training batches, for a window of steady steps: the batch's fetch,
transfer and transform, the step, the metric updates and every callback.

:data:`HOST_SYNC_OPS` are the operations that make the host wait for a GPU (a scalar read, a data-dependent
shape): on a CPU they are harmless but still counted, so a test on CPU guards the GPU path against them.
"""

from __future__ import annotations

import collections
from typing import Any

from lightning import Callback, LightningModule, Trainer
from torch.utils._python_dispatch import TorchDispatchMode

# aten operations that synchronize a CUDA device with the host: .item()/float()/bool() read a scalar
# (_local_scalar_dense), and these produce a shape that depends on the data.
HOST_SYNC_OPS = frozenset({"_local_scalar_dense", "nonzero", "is_nonzero", "equal", "masked_select", "unique_dim",
                           "_unique2", "unique_consecutive", "repeat_interleave", "bincount", "histc"})


class OpCount(TorchDispatchMode):
    """Counts every aten operation dispatched while active, by name (``aten.add_.Tensor`` -> ``add_``)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    @property
    def host_syncs(self) -> dict[str, int]:
        return {name: n for name, n in self.counts.items() if name in HOST_SYNC_OPS}


class StepOpCount(Callback):
    """Counts the operations of training steps ``start + 1 .. start + steps`` of the first epoch.

    ``per_step`` (after the window): operations per step; ``mode.counts``: every operation by name.
    """

    def __init__(self, start: int = 5, steps: int = 20) -> None:
        self.start, self.steps = start, steps
        self.mode: OpCount | None = None
        self.per_step: float | None = None

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        if trainer.current_epoch != 0:
            return
        if batch_idx == self.start:
            self.mode = OpCount()
            self.mode.__enter__()
        elif batch_idx == self.start + self.steps and self.mode is not None and self.per_step is None:
            self.mode.__exit__(None, None, None)
            self.per_step = sum(self.mode.counts.values()) / self.steps
