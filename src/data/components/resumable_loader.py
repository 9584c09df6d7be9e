"""A DataLoader that can resume in the middle of an epoch, and a shuffle that can be rebuilt for any epoch.

Lightning 2 saves the state of training loaders that implement ``state_dict``/``load_state_dict``
(its ``_Stateful`` protocol) in every checkpoint, and hands it back before the first ``iter()`` of a
resumed run. torch's DataLoader has no such state; these two classes add the smallest one that makes
a resumed epoch see exactly the batches an uninterrupted run would have seen:

* :class:`EpochShuffle` draws each epoch's order from ``(seed, epoch)`` alone, never from the global
  RNG, so the order of a half-finished epoch can be rebuilt after a restart;
* :class:`ResumableDataLoader` counts the batches it has handed out in the current epoch and, once
  restored, skips that many on its next iteration.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, RandomSampler

from src.utils.seeding import rank_seed


class EpochShuffle(RandomSampler):
    """A random permutation per epoch, seeded from ``(seed, epoch)``; the loop calls :meth:`set_epoch`.

    A subclass of :class:`RandomSampler`, so Lightning still sees a shuffled loader and swaps in its
    ``DistributedSampler`` (itself seeded from seed and epoch) when the run has several replicas.
    """

    def __init__(self, data_source: Sized, seed: int) -> None:
        super().__init__(data_source, generator=torch.Generator())
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        self.generator.manual_seed(rank_seed(self.seed, 0, f"shuffle-epoch-{self.epoch}"))
        return super().__iter__()


class ResumableDataLoader(DataLoader):
    """A DataLoader whose position within the epoch is saved in checkpoints and restored on resume.

    The state is the sampler's epoch and the number of batches handed out in that epoch. Lightning
    knows the loader's length, so it does not prefetch: at a checkpoint, every batch handed out has
    been trained on. Skipped batches are fetched and dropped rather than skipped in the sampler, which
    keeps worker processes (and any randomness they hold) in step with an uninterrupted run.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._batches_done = 0
        self._resume_at: tuple[int | None, int] | None = None  # (epoch, batches done) from a checkpoint

    def state_dict(self) -> dict[str, int | None]:
        return {"epoch": getattr(self.sampler, "epoch", None), "batches_done": self._batches_done}

    def load_state_dict(self, state: dict[str, int | None]) -> None:
        epoch = state.get("epoch")
        if epoch is not None and hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)
        self._resume_at = (epoch, int(state.get("batches_done") or 0))

    def __iter__(self) -> Iterator[Any]:
        # Runs at the first next(), after the loop set this epoch. A checkpoint taken at the end of an
        # epoch restores a position the loop never iterates again: it must not skip the next epoch's batches.
        resume_at, self._resume_at = self._resume_at, None
        skip = resume_at[1] if resume_at and resume_at[0] == getattr(self.sampler, "epoch", None) else 0
        self._batches_done = 0
        batches = super().__iter__()
        for _ in range(skip):
            if next(batches, None) is None:
                return
            self._batches_done += 1
        for batch in batches:
            self._batches_done += 1
            yield batch
