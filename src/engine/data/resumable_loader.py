"""A DataLoader that can resume in the middle of an epoch, on any number of ranks, and the shuffle behind it.

Lightning 2 saves the state of training loaders that implement ``state_dict``/``load_state_dict``
(its ``_Stateful`` protocol) in every checkpoint, and hands it back before the first ``iter()`` of a
resumed run. torch's DataLoader has no such state; these two classes add the smallest one that makes
a resumed epoch see exactly the batches an uninterrupted run would have seen:

* :class:`GlobalBatchShuffle` draws each epoch's order from ``(seed, epoch)`` alone, never from the global
  RNG, cuts it into global batches, and gives each replica its slice of every global batch. The global
  batches depend on the seed, the epoch and the global batch size only: one process, DDP on any number of
  ranks, fsdp and dp train on the same samples in the same order;
* :class:`ResumableDataLoader` counts the global batches handed out in the current epoch and, once
  restored, skips that many on its next iteration, whatever the number of ranks now.

Where the data set lives on a device (``index_device``), the loader cuts its batches there: once per epoch it
copies this rank's whole order to that device (one copy), and each batch is a slice of it, which the dataset
gathers with on the device. Without it each batch's indices are a host list, made a tensor and copied to the
device on their own (a copy per batch and per step of the input pipeline). The order, the batches, the
resume position and the ``state_dict`` are the same on both paths.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, DistributedSampler

from src.engine.utils.errors import ConfigError
from src.engine.utils.seeding import rank_seed


class GlobalBatchShuffle(DistributedSampler):
    """One permutation per epoch from ``(seed, epoch)``, cut into global batches; replica ``rank`` of
    ``num_replicas`` takes the ``rank``-th contiguous slice of each. The loop calls :meth:`set_epoch`.

    The last incomplete global batch is dropped, so every replica takes the same number of steps and no
    sample is repeated (torch's ``DistributedSampler`` pads instead, and deals samples round-robin, which
    makes the batches depend on the number of ranks). A ``DistributedSampler`` subclass, so Lightning
    keeps it rather than injecting its own.
    """

    def __init__(self, data_source: Sized, seed: int, global_batch: int, num_replicas: int = 1, rank: int = 0) -> None:
        super().__init__(data_source, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True)
        if global_batch % num_replicas:
            raise ValueError(f"a global batch of {global_batch} does not split over {num_replicas} replicas")
        self.global_batch = global_batch
        self.local_batch = global_batch // num_replicas
        self.global_batches = len(data_source) // global_batch
        self.num_samples = self.global_batches * self.local_batch
        self.total_size = self.global_batches * global_batch

    def rank_batches(self) -> Tensor:
        """This replica's batches of the current epoch in order: int64 ``(global_batches, local_batch)``, on the host."""
        generator = torch.Generator().manual_seed(rank_seed(self.seed, 0, f"shuffle-epoch-{self.epoch}"))
        order = torch.randperm(len(self.dataset), generator=generator)[: self.total_size]
        return order.view(self.global_batches, self.num_replicas, self.local_batch)[:, self.rank].contiguous()

    def __iter__(self) -> Iterator[int]:
        return iter(self.rank_batches().reshape(-1).tolist())


class ResumableDataLoader(DataLoader):
    """A DataLoader whose position within the epoch is saved in checkpoints and restored on resume.

    The state is the sampler's epoch, the number of batches handed out in that epoch and the global batch
    size. Every replica hands out one slice of each global batch, so the count is the same on every rank and
    means the same position at any number of ranks; a changed global batch cannot resume mid-epoch. Lightning
    knows the loader's length, so it does not prefetch: at a checkpoint, every batch handed out has
    been trained on. Skipped batches are fetched and dropped rather than skipped in the sampler, which
    keeps worker processes (and any randomness they hold) in step with an uninterrupted run.

    ``index_device``: the device the dataset lives on, for a :class:`GlobalBatchShuffle` sampler and no worker
    processes. Each epoch, :meth:`GlobalBatchShuffle.rank_batches` crosses to that device in one copy and batch
    ``i`` is its row ``i`` (a view: no copy, no sync), handed to the dataset's ``__getitems__`` (then
    ``collate_fn``) as torch's own fetcher would hand it the host list. The batches are the host path's, bit for
    bit. No worker holds a random state here, so a resumed epoch starts at its position without fetching the
    skipped batches. Only the iteration differs: Lightning still sees a DataLoader with a ``DistributedSampler``
    (which it keeps), and ``len``, ``sampler``, ``set_epoch`` and the state are unchanged.
    """

    def __init__(self, *args: Any, index_device: torch.device | str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.index_device = None if index_device is None else torch.device(index_device)
        if self.index_device is not None:
            if not hasattr(self.sampler, "rank_batches"):
                raise ValueError(f"index_device needs a GlobalBatchShuffle sampler, not a {type(self.sampler).__name__}")
            if self.num_workers or self.pin_memory:
                raise ValueError("index_device cuts batches where the data lives, in this process: it takes neither "
                                 "worker processes nor pinned memory")
        self._batches_done = 0
        self._counted_epoch: int | None = None  # the epoch whose batches _batches_done counts
        self._resume_at: tuple[int | None, int] | None = None  # (epoch, batches done) from a checkpoint

    def state_dict(self) -> dict[str, int | None]:
        # Saved before an epoch's first batch (an agreed stop is made at a batch's start), the position is a
        # restored one not yet skipped to, or the epoch's start: the count is still the last epoch's.
        epoch = self._epoch()
        counted = self._resume_at or (self._counted_epoch, self._batches_done)
        return {"epoch": epoch, "batches_done": counted[1] if counted[0] == epoch else 0,
                "global_batch": self._global_batch()}

    def load_state_dict(self, state: dict[str, int | None]) -> None:
        epoch, done = state.get("epoch"), int(state.get("batches_done") or 0)
        saved, now = state.get("global_batch"), self._global_batch()
        if done and saved is not None and saved != now and done < len(self.dataset) // saved:  # stopped mid-epoch
            raise ConfigError(f"the checkpoint stopped mid-epoch with a global batch of {saved} samples, this run's is "
                              f"{now}: the rest of that epoch cannot be found; fix: resume with data.batch_size={saved}")
        if epoch is not None and hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)
        self._resume_at = (epoch, done)

    def _epoch(self) -> int | None:
        return getattr(self.sampler, "epoch", None)

    def _global_batch(self) -> int | None:
        return getattr(self.sampler, "global_batch", None)

    def __iter__(self) -> Iterator[Any]:
        # Runs at the first next(), after the loop set this epoch. A checkpoint taken at the end of an
        # epoch restores a position the loop never iterates again: it must not skip the next epoch's batches.
        resume_at, self._resume_at = self._resume_at, None
        epoch = self._epoch()
        skip = resume_at[1] if resume_at and resume_at[0] == epoch else 0
        self._batches_done, self._counted_epoch = 0, epoch
        if self.index_device is not None:
            yield from self._device_batches(skip)
            return
        batches = super().__iter__()
        for _ in range(skip):
            if next(batches, None) is None:
                return
            self._batches_done += 1
        for batch in batches:
            self._batches_done += 1
            yield batch

    def _device_batches(self, skip: int) -> Iterator[Any]:
        """This epoch's batches from ``skip`` on, cut on ``index_device`` (see the class docstring)."""
        order = self.sampler.rank_batches()
        if self.index_device.type == "cuda":  # from pinned memory the copy is queued, not waited for
            order = order.pin_memory()
        order = order.to(self.index_device, non_blocking=True)
        self._batches_done = min(skip, len(order))
        getitems = getattr(self.dataset, "__getitems__", None)
        for batch in range(self._batches_done, len(order)):
            indices = order[batch]
            fetched = getitems(indices) if getitems else [self.dataset[i] for i in indices]
            self._batches_done += 1
            yield self.collate_fn(fetched)
