"""A bench-only callback: after every Lightning training step, one plain PyTorch step of the same work.

Comparing separate runs on a shared machine mixes the per-step overhead with whatever the machine did
during each run. Here the two alternate step by step in one process, so both see the same clock speed,
the same other tenants and the same warm caches, and the difference of their medians is the cost of
Lightning's loop plus what the run adds on top (progress bar, logging, callbacks, metric updates).

The Lightning step is timed from the end of this callback's previous call to the start of its next
one, so it holds everything Lightning and the other callbacks do per step. The plain step is the
``plain_loop`` step: gather a batch (normalized once), forward, loss, zero_grad, backward, Adam step, and
tensor-side loss/accuracy sums, on the trainer's device (the data set held there, as ``plain_loop``
holds it on a GPU) and under its precision (``bf16-mixed``: forward and loss under bf16 autocast). On a
GPU each timer is read after ``torch.cuda.synchronize()``, so each step's time holds its device work.
Added on the command line, not in any config:
``+callbacks.bench_paired._target_=scripts.bench.paired_step.PairedPlainStep +callbacks.bench_paired.out=<file>``.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from lightning import Callback, LightningModule, Trainer

from scripts.bench.plain_loop import (
    ROOT,
    autocast_for,
    build_mlp,
    in_memory_batches,
    normalize,
    synchronize,
    train_step,
    train_val_split,
)


class PairedPlainStep(Callback):
    """Times each Lightning training step and one interleaved plain step; writes medians to ``out`` (JSON)."""

    def __init__(self, out: str, data_dir: str = str(ROOT / "data"), lr: float = 1e-3, seed: int = 12345,
                 warmup_epochs: int = 1) -> None:
        self.out, self.data_dir, self.lr, self.seed, self.warmup_epochs = Path(out), data_dir, lr, seed, warmup_epochs
        self.lightning_s: list[float] = []
        self.plain_s: list[float] = []
        self._resumed: float | None = None
        self._batches: Iterator = iter(())

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if trainer.world_size != 1:
            raise RuntimeError("PairedPlainStep measures one process; run it without DDP")
        self.device = device = trainer.strategy.root_device
        if trainer.precision not in ("32-true", "bf16-mixed"):
            raise RuntimeError(f"PairedPlainStep does precision 32-true or bf16-mixed, not {trainer.precision}")
        self.precision = trainer.precision
        self.autocast = autocast_for(device, self.precision)
        x, y, train_idx, _ = train_val_split(self.data_dir, self.seed)
        self.x, self.y = normalize(x[train_idx].to(device)), y[train_idx].to(device)
        self.net = build_mlp().to(device)
        self.optimizer = torch.optim.Adam(self.net.parameters(), lr=self.lr, fused=True)
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.correct = torch.zeros((), dtype=torch.long, device=device)

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._resumed = None  # the epoch's first step also holds the loader's start-up

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        synchronize(self.device)
        now = time.perf_counter()
        counted = trainer.current_epoch >= self.warmup_epochs
        if counted and self._resumed is not None:
            self.lightning_s.append(now - self._resumed)
        start = time.perf_counter()
        self._plain_step(len(batch[-1]))
        synchronize(self.device)
        if counted:
            self.plain_s.append(time.perf_counter() - start)
        self._resumed = time.perf_counter()

    def _plain_step(self, batch_size: int) -> None:
        try:
            xb, yb = next(self._batches)
        except StopIteration:  # first call, or one pass over the data is done
            self._batches = in_memory_batches(self.x, self.y, batch_size, shuffle=True, drop_last=True)
            xb, yb = next(self._batches)
        batch_loss, batch_correct = train_step(self.net, self.optimizer, xb, yb, self.autocast)
        self.loss_sum += batch_loss
        self.correct += batch_correct

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.lightning_s:
            return
        record = {"lightning_ms": 1e3 * statistics.median(self.lightning_s),
                  "plain_ms": 1e3 * statistics.median(self.plain_s), "steps": len(self.lightning_s),
                  "threads": torch.get_num_threads(), "device": str(self.device), "precision": self.precision}
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(record))
