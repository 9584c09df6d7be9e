"""Batches cut on the data's device (``ResumableDataLoader(index_device=...)``) are the host path's batches, bit for
bit: at world sizes 1 and 2, across epochs, and across a mid-epoch resume; the indices cross once per epoch.

Without a GPU the data "lives" on the cpu device, as on a CPU trainer (``InMemoryDataModule._placement``); the
meta device stands in for a device the host cannot read, to show the indices reach it before the dataset does.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.accelerators import CPUAccelerator

from src.data.toy_datamodule import ToyDataModule
from src.engine.data.in_memory import InMemoryDataset, keep_batch
from src.engine.data.resumable_loader import GlobalBatchShuffle, ResumableDataLoader
from tests.helpers.multiprocess import run_workers
from tests.helpers.run_if import gpu_test

N, GLOBAL = 50, 12  # 4 global batches; the last 2 samples are dropped


def dataset(n: int = N, device: str = "cpu") -> InMemoryDataset:
    inputs = torch.randn(n, 3, 2, 2, generator=torch.Generator().manual_seed(0))
    return InMemoryDataset(inputs.to(device), torch.arange(n).to(device))


def make_loader(device: str | None, replicas: int = 1, rank: int = 0, data: InMemoryDataset | None = None,
                global_batch: int = GLOBAL) -> ResumableDataLoader:
    """``device=None``: the host path (a host list of indices per batch), as before the device path existed."""
    data = data if data is not None else dataset()
    sampler = GlobalBatchShuffle(data, seed=7, global_batch=global_batch, num_replicas=replicas, rank=rank)
    return ResumableDataLoader(data, batch_size=global_batch // replicas, sampler=sampler, collate_fn=keep_batch,
                               drop_last=True, index_device=device)


def batches(loader: ResumableDataLoader, epoch: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if epoch is not None:
        loader.sampler.set_epoch(epoch)
    return list(loader)


def assert_same(got: list, expected: list) -> None:
    assert len(got) == len(expected) and expected
    for (x, y), (ex, ey) in zip(got, expected, strict=True):
        assert torch.equal(x, ex) and torch.equal(y, ey)
        assert x.dtype == ex.dtype and y.dtype == ey.dtype and x.shape == ex.shape


@pytest.mark.fast
@pytest.mark.parametrize("replicas", [1, 2])
def test_device_batches_equal_the_host_path(replicas):
    for epoch in (0, 3):
        for rank in range(replicas):
            host = batches(make_loader(None, replicas, rank), epoch)
            device = batches(make_loader("cpu", replicas, rank), epoch)
            assert len(host) == N // GLOBAL
            assert_same(device, host)
    # the two ranks' batches together are the one-process global batches
    ranks = [batches(make_loader("cpu", 2, r), 1) for r in range(2)]
    one = batches(make_loader(None), 1)
    for step, (x, y) in enumerate(one):
        assert torch.equal(torch.cat([ranks[0][step][1], ranks[1][step][1]]), y)
        assert torch.equal(torch.cat([ranks[0][step][0], ranks[1][step][0]]), x)


@pytest.mark.fast
@pytest.mark.parametrize("replicas", [1, 2])
def test_a_mid_epoch_resume_on_the_device_path_gives_the_remaining_batches(replicas):
    """A state saved after k batches (host or device path), loaded by a new device-path loader: the rest of the
    epoch equals the uninterrupted host run's rest, and the saved state is the host path's, key for key."""
    for rank in range(replicas):
        full = batches(make_loader(None, replicas, rank), 2)
        for k in (1, 3):
            states = []
            for saver in (None, "cpu"):
                loader = make_loader(saver, replicas, rank)
                loader.sampler.set_epoch(2)
                it = iter(loader)
                seen = [next(it) for _ in range(k)]
                assert_same(seen, full[:k])
                states.append(loader.state_dict())
            assert states[0] == states[1] == {"epoch": 2, "batches_done": k, "global_batch": GLOBAL}
            resumed = make_loader("cpu", replicas, rank)  # a new process: fresh loader, state from the checkpoint
            resumed.load_state_dict(states[0])
            it = iter(resumed)
            rest = list(it)
            assert_same(rest, full[k:])
            assert resumed.state_dict() == {"epoch": 2, "batches_done": len(full), "global_batch": GLOBAL}


@pytest.mark.fast
def test_a_one_rank_position_resumes_on_two_ranks_on_the_device_path():
    """Stopped after 2 global batches in one process (host path, an older checkpoint), resumed on 2 ranks cutting on
    the device: the ranks' remaining batches together are the one-process run's remaining batches."""
    single = make_loader(None, global_batch=8)
    single.sampler.set_epoch(5)
    it = iter(single)
    [next(it) for _ in range(2)]
    state = single.state_dict()
    full = batches(make_loader(None, global_batch=8), 5)
    halves = []
    for rank in range(2):
        resumed = make_loader("cpu", 2, rank, global_batch=8)
        resumed.load_state_dict(state)
        halves.append(list(resumed))
    assert len(halves[0]) == len(full) - 2
    for (x0, y0), (x1, y1), (x, y) in zip(*halves, full[2:], strict=True):
        assert torch.equal(torch.cat([x0, x1]), x) and torch.equal(torch.cat([y0, y1]), y)


@pytest.mark.fast
def test_an_end_of_epoch_state_does_not_skip_the_next_epoch_on_the_device_path():
    loader = make_loader("cpu")
    loader.load_state_dict({"epoch": 2, "batches_done": len(loader), "global_batch": GLOBAL})
    loader.sampler.set_epoch(2)
    assert list(loader) == []  # the restored epoch is over
    assert_same(batches(loader, 3), batches(make_loader(None), 3))


@pytest.mark.fast
def test_the_indices_cross_to_the_device_once_per_epoch(monkeypatch):
    """Every batch's indices reach ``__getitems__`` already on the data's device (meta here), as views of one tensor
    per epoch: one copy per epoch, none per batch. The host path hands a host list instead."""
    received: list = []
    original = InMemoryDataset.__getitems__

    def recording(self, indices):
        received.append(indices)
        return original(self, indices)

    monkeypatch.setattr(InMemoryDataset, "__getitems__", recording)
    meta = dataset(device="meta")
    for epoch in (0, 1):
        received.clear()
        out = batches(make_loader("meta", data=meta), epoch)
        assert len(out) == len(received) == N // GLOBAL
        assert all(x.is_meta and y.is_meta for x, y in out)
        assert all(isinstance(i, torch.Tensor) and i.is_meta and i.dtype == torch.int64 for i in received)
        assert received[0]._base is not None and all(i._base is received[0]._base for i in received)  # views of one
    received.clear()
    batches(make_loader(None), 0)
    assert all(isinstance(i, list) for i in received) and len(received) == N // GLOBAL


@pytest.mark.fast
def test_the_device_path_takes_no_workers_and_a_distributed_sampler_only():
    data = dataset()
    sampler = GlobalBatchShuffle(data, seed=7, global_batch=4)
    with pytest.raises(ValueError, match="neither worker processes nor pinned memory"):
        ResumableDataLoader(data, batch_size=4, sampler=sampler, num_workers=1, index_device="cpu")
    with pytest.raises(ValueError, match="GlobalBatchShuffle sampler"):
        ResumableDataLoader(data, batch_size=4, index_device="cpu")


def toy(on_device: bool | str, replicas: int = 1, rank: int = 0) -> ToyDataModule:
    """A toy DataModule set up under a stand-in CPU trainer of ``replicas`` data-parallel ranks."""
    dm = ToyDataModule(num_samples=300, num_test=40, val_size=44, batch_size=16, on_device=on_device)
    strategy = SimpleNamespace(root_device=torch.device("cpu"),
                               distributed_sampler_kwargs={"num_replicas": replicas, "rank": rank})
    dm.trainer = SimpleNamespace(strategy=strategy, accelerator=CPUAccelerator(), global_rank=rank)
    dm.setup("fit")
    return dm


@pytest.mark.fast
@pytest.mark.parametrize("replicas", [1, 2])
def test_the_datamodule_cuts_on_the_device_where_its_data_lives(replicas):
    for rank in range(replicas):
        placed, host = toy("auto", replicas, rank), toy(False, replicas, rank)
        assert placed.data_device == torch.device("cpu") and host.data_device is None
        on_device, on_host = placed.train_dataloader(), host.train_dataloader()
        assert on_device.index_device == torch.device("cpu") and on_host.index_device is None
        assert_same(batches(on_device, 1), batches(on_host, 1))
        assert len(on_device) == len(on_host) == 256 // 16


@pytest.mark.fast
def test_workers_keep_the_host_path():
    dm = toy("auto")
    dm.hparams.num_workers = 2  # ToyDataModule does not take it; an InMemoryDataModule does
    loader = dm.train_dataloader()
    assert loader.index_device is None and loader.num_workers == 2


def gloo_rank_batches(rank: int, world_size: int) -> list[list[int]]:
    """One gloo rank: its replica index from the process group, its device-cut targets of epoch 1."""
    import torch.distributed as dist

    loader = make_loader("cpu", dist.get_world_size(), dist.get_rank())
    return [y.tolist() for _, y in batches(loader, 1)]


@pytest.mark.slow
def test_real_gloo_ranks_cut_the_one_process_global_batches():
    ranks = run_workers(gloo_rank_batches, 2)
    one = [y.tolist() for _, y in batches(make_loader(None), 1)]
    assert [a + b for a, b in zip(*ranks, strict=True)] == one


@gpu_test(1)
@pytest.mark.parametrize("replicas", [1, 2])
def test_device_batches_on_a_gpu_equal_the_host_path_and_never_sync(replicas):
    """On a GPU: the batches cut there are the per-batch-copy path's, and a whole epoch of them (the one copy of
    its order included) runs under ``set_sync_debug_mode("error")``: no host-device sync anywhere."""
    data = dataset(device="cuda")
    for rank in range(replicas):
        host = batches(make_loader(None, replicas, rank, data=data), 1)
        loader = make_loader("cuda", replicas, rank, data=data)
        batches(loader, 0)  # warm-up: the first pinned allocation and kernels
        torch.cuda.synchronize()
        loader.sampler.set_epoch(1)
        torch.cuda.set_sync_debug_mode("error")
        try:
            device = list(loader)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert all(x.is_cuda and y.is_cuda for x, y in device)
        assert_same(device, host)
