"""The resumable loader and the epoch-seeded shuffle, without a Trainer: what Lightning does around them."""

from __future__ import annotations

import pytest
import torch

from src.data.components.in_memory import InMemoryDataset, keep_batch
from src.data.components.resumable_loader import EpochShuffle, ResumableDataLoader

pytestmark = pytest.mark.fast


def make_loader() -> ResumableDataLoader:
    data = InMemoryDataset(torch.arange(40).float().unsqueeze(1), torch.arange(40))
    return ResumableDataLoader(data, batch_size=4, sampler=EpochShuffle(data, seed=7), collate_fn=keep_batch)


def epoch_batches(loader: ResumableDataLoader, epoch: int) -> list[list[int]]:
    loader.sampler.set_epoch(epoch)
    return [targets.tolist() for _, targets in loader]


def test_order_depends_on_seed_and_epoch_only():
    a, b = make_loader(), make_loader()
    torch.manual_seed(0)
    first = epoch_batches(a, 3)
    torch.manual_seed(1)  # the global RNG plays no part
    assert epoch_batches(b, 3) == first
    assert epoch_batches(b, 4) != first
    assert sorted(sum(first, [])) == list(range(40))


def test_mid_epoch_state_resumes_with_the_remaining_batches():
    loader = make_loader()
    loader.sampler.set_epoch(2)
    full = epoch_batches(make_loader(), 2)
    it = iter(loader)
    seen = [next(it)[1].tolist() for _ in range(4)]
    state = loader.state_dict()
    assert state == {"epoch": 2, "batches_done": 4}

    resumed = make_loader()  # a new process: fresh loader, state from the checkpoint
    resumed.load_state_dict(state)
    rest = [targets.tolist() for _, targets in resumed]
    assert seen + rest == full


def test_end_of_epoch_state_does_not_skip_the_next_epoch():
    loader = make_loader()
    finished = {"epoch": 2, "batches_done": len(loader)}
    loader.load_state_dict(finished)
    iter(loader)  # the loop builds the restored epoch's iterator but never draws from it
    assert epoch_batches(loader, 3) == epoch_batches(make_loader(), 3)
