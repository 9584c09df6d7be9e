"""A stop signal that reaches a DataLoader's workers (a cluster signals every process of the job) leaves them
working: their rank makes the agreed stop instead of failing at its next batch. Real worker processes."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from src.engine.runtime.loader_workers import (
    IgnoreStopSignals,
    WorkersOutliveStopSignals,
    workers_ignore_stop_signals,
)

pytestmark = pytest.mark.fast

N = 40


class WorkerPids(Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(0.02)
        return torch.tensor(os.getpid())


def kill_the_workers_then_drain(loader: DataLoader) -> int:
    """Fetch a few batches, SIGTERM every worker that made one, then fetch the rest: how many came in all."""
    it = iter(loader)
    pids = {int(next(it)) for _ in range(6)}
    assert os.getpid() not in pids  # they came from the workers
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    time.sleep(0.5)
    return 6 + sum(1 for _ in it)


def test_workers_that_ignore_the_stop_signals_finish_the_epoch():
    loader = workers_ignore_stop_signals(DataLoader(WorkerPids(), batch_size=1, num_workers=2))
    assert kill_the_workers_then_drain(loader) == N


def test_torchs_own_workers_die_of_it():
    """What the project's loaders are kept from: the same signal ends torch's workers and fails the epoch."""
    with pytest.raises(RuntimeError, match="DataLoader worker"):  # "killed by signal" or "exited unexpectedly"
        kill_the_workers_then_drain(DataLoader(WorkerPids(), batch_size=1, num_workers=2))


def test_the_loaders_own_worker_init_fn_still_runs_once():
    def own(worker_id: int) -> None:
        pass

    loader = DataLoader(WorkerPids(), num_workers=1, worker_init_fn=own)
    assert workers_ignore_stop_signals(workers_ignore_stop_signals(loader)) is loader
    assert isinstance(loader.worker_init_fn, IgnoreStopSignals) and loader.worker_init_fn.inner is own
    plain = DataLoader(WorkerPids())  # no workers: nothing to change
    assert workers_ignore_stop_signals(plain).worker_init_fn is None


def test_every_project_strategy_hands_lightning_such_loaders():
    from src.engine.strategies.ddp import DDPStrategy
    from src.engine.strategies.dp.strategy import DataParallelStrategy
    from src.engine.strategies.fsdp.strategy import FSDPStrategy
    from src.engine.strategies.pipeline.strategy import PipelineStrategy
    from src.engine.strategies.ps.strategy import ParameterServerStrategy
    from src.engine.strategies.single_device import SingleDeviceStrategy

    for cls in (DDPStrategy, DataParallelStrategy, FSDPStrategy, PipelineStrategy, ParameterServerStrategy,
                SingleDeviceStrategy):
        assert issubclass(cls, WorkersOutliveStopSignals), cls
    strategy = SingleDeviceStrategy(device=torch.device("cpu"))
    loader = strategy.process_dataloader(DataLoader(WorkerPids(), num_workers=1))
    assert isinstance(loader.worker_init_fn, IgnoreStopSignals)
