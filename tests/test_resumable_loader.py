"""The resumable loader and the global-batch shuffle, without a Trainer: what Lightning does around them."""

from __future__ import annotations

import pytest
import torch

from src.engine.data.in_memory import InMemoryDataset, keep_batch
from src.engine.data.resumable_loader import GlobalBatchShuffle, ResumableDataLoader
from src.engine.utils.errors import ConfigError

pytestmark = pytest.mark.fast


def make_loader(replicas: int = 1, rank: int = 0, global_batch: int = 4, n: int = 40) -> ResumableDataLoader:
    data = InMemoryDataset(torch.arange(n).float().unsqueeze(1), torch.arange(n))
    sampler = GlobalBatchShuffle(data, seed=7, global_batch=global_batch, num_replicas=replicas, rank=rank)
    return ResumableDataLoader(data, batch_size=global_batch // replicas, sampler=sampler, collate_fn=keep_batch)


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
    assert state == {"epoch": 2, "batches_done": 4, "global_batch": 4}

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


def test_a_save_before_the_new_epochs_first_batch_holds_no_batch_of_it():
    """Between the loop's ``set_epoch`` and the new epoch's first batch (where the agreed SIGTERM stop of a
    multi-process run saves), the position is the start of the new epoch, not the last epoch's count."""
    loader = make_loader()
    epoch_batches(loader, 0)
    loader.sampler.set_epoch(1)
    iter(loader)  # the loop has asked for the iterator, not yet for a batch
    state = loader.state_dict()
    assert state == {"epoch": 1, "batches_done": 0, "global_batch": 4}
    resumed = make_loader()
    resumed.load_state_dict(state)
    assert epoch_batches(resumed, 1) == epoch_batches(make_loader(), 1)


def test_a_restored_position_is_saved_again_before_it_is_skipped_to():
    """Restored mid-epoch and saved again before the first batch: the same position, not the epoch's start."""
    state = {"epoch": 2, "batches_done": 4, "global_batch": 4}
    loader = make_loader()
    loader.load_state_dict(state)
    loader.sampler.set_epoch(2)
    iter(loader)
    assert loader.state_dict() == state


@pytest.mark.parametrize("replicas", [2, 3, 6])
def test_replicas_take_slices_of_the_one_process_global_batches(replicas):
    """Rank r's i-th batch is the r-th slice of the one-process run's i-th batch: the same samples in the same
    order at any number of ranks. 50 samples, global batch 12: the last 2 samples are dropped everywhere."""
    single = epoch_batches(make_loader(global_batch=12, n=50), 1)
    ranks = [epoch_batches(make_loader(replicas, r, global_batch=12, n=50), 1) for r in range(replicas)]
    assert len(single) == 4 and all(len(batches) == 4 for batches in ranks)
    for step, batch in enumerate(single):
        assert sum((ranks[r][step] for r in range(replicas)), []) == batch
    seen = sum(single, [])
    assert len(set(seen)) == 48  # no sample twice, no padding


def test_a_mid_epoch_position_resumes_on_another_number_of_ranks():
    """Stopped after 2 global batches at 1 rank, resumed at 2: the ranks' remaining batches together are the
    one-process run's remaining batches."""
    single = make_loader(global_batch=8)
    single.sampler.set_epoch(5)
    it = iter(single)
    [next(it) for _ in range(2)]
    state = single.state_dict()
    assert state == {"epoch": 5, "batches_done": 2, "global_batch": 8}
    full = epoch_batches(make_loader(global_batch=8), 5)
    halves = []
    for rank in range(2):
        resumed = make_loader(2, rank, global_batch=8)
        resumed.load_state_dict(state)
        halves.append([targets.tolist() for _, targets in resumed])
    assert [a + b for a, b in zip(*halves, strict=True)] == full[2:]


def test_a_changed_global_batch_refuses_a_mid_epoch_position():
    state = {"epoch": 1, "batches_done": 3, "global_batch": 8}
    with pytest.raises(ConfigError, match=r"global batch of 8 .* fix: resume with data.batch_size=8"):
        make_loader(global_batch=4).load_state_dict(state)
    for boundary in (0, 5):  # at an epoch's start or end (40 samples: 5 global batches of 8), nothing is lost
        make_loader(global_batch=4).load_state_dict({**state, "batches_done": boundary})
