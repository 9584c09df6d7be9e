"""What one training batch costs on a CPU before any model work: Lightning's loop, and the project's loader.

    python -m scripts.studies.loop_floor                  # 5 rounds
    python -m scripts.studies.loop_floor --rounds 3 --batches 3000

Two questions behind the owned step's CPU figures (docs/benchmarks.md):

* **Lightning's loop alone.** ``Trainer(barebones=True)`` fits a module whose manual-optimization
  ``training_step`` does nothing, over an in-memory list of batches: the time per batch is what the fit loop
  itself costs (fetching, hooks, progress counters), with no callbacks, logger, metrics or optimizer.
* **The loader.** One epoch of the project's training loader
  (:class:`~src.engine.data.resumable_loader.ResumableDataLoader` over
  :class:`~src.engine.data.in_memory.InMemoryDataset`, Fashion-MNIST-sized tensors, batch 128) against
  the plain loop's batches: one permutation, sliced, and two ``index_select`` calls per batch.

Each round measures both in turn (one torch thread); the report gives per-batch medians (min-max) over rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import lightning as L
import torch

from src.engine.data.in_memory import InMemoryDataset, keep_batch
from src.engine.data.resumable_loader import GlobalBatchShuffle, ResumableDataLoader

SAMPLES, FEATURES, BATCH = 60_000, 784, 128


class NoOpStep(L.LightningModule):
    """A manual-optimization module whose step does nothing: the loop's own cost per batch."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.layer = torch.nn.Linear(1, 1)  # Lightning wants a parameter for the optimizer

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        return None

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loop_us_per_batch(batches: int) -> float:
    data = [torch.zeros(1)] * batches
    trainer = L.Trainer(barebones=True, max_epochs=1, accelerator="cpu", devices=1, logger=False)
    start = time.perf_counter()
    trainer.fit(NoOpStep(), data)
    return (time.perf_counter() - start) / batches * 1e6


def loader_us_per_batch(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    dataset = InMemoryDataset(x, y)
    loader = ResumableDataLoader(dataset, batch_size=BATCH, collate_fn=keep_batch, drop_last=True,
                                 sampler=GlobalBatchShuffle(dataset, seed=1, global_batch=BATCH))
    start, n = time.perf_counter(), 0
    for _ in loader:
        n += 1
    project = (time.perf_counter() - start) / n * 1e6
    start = time.perf_counter()
    order = torch.randperm(SAMPLES)
    for i in range(SAMPLES // BATCH):
        index = order[i * BATCH:(i + 1) * BATCH]
        x.index_select(0, index), y.index_select(0, index)
    plain = (time.perf_counter() - start) / (SAMPLES // BATCH) * 1e6
    return project, plain


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, default=5000, help="batches of the no-op fit")
    args = parser.parse_args()
    torch.set_num_threads(1)
    x, y = torch.randn(SAMPLES, FEATURES), torch.randint(0, 10, (SAMPLES,))
    rows: dict[str, list[float]] = {"Lightning's loop, no-op step": [], "project loader": [], "plain batches": []}
    for _ in range(args.rounds):
        rows["Lightning's loop, no-op step"].append(loop_us_per_batch(args.batches))
        project, plain = loader_us_per_batch(x, y)
        rows["project loader"].append(project)
        rows["plain batches"].append(plain)
    for name, values in rows.items():
        print(f"{name:30s} {statistics.median(values):7.1f} us per batch ({min(values):.1f}-{max(values):.1f})")


if __name__ == "__main__":
    main()
