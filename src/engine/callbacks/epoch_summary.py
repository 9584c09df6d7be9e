"""One line per training epoch: wall time, samples/s, and the epoch's metrics."""

from __future__ import annotations

import time

from lightning import Callback, LightningModule, Trainer

from src.engine.strategies.global_batch import data_replica
from src.engine.utils.pylogger import RankedLogger

log = RankedLogger(__name__)


class EpochSummary(Callback):
    """Times each training epoch and counts the samples all ranks processed in it.

    Throughput covers the training batches only (first batch start to last batch end);
    the epoch time also includes validation. Counting uses ``len(target)`` (no device
    sync); the line is printed on rank 0 and the throughput is logged as ``perf/samples_per_sec``.
    Why not Lightning's ``ThroughputMonitor``: to time each batch it synchronizes the GPU after every
    one, a host-device sync per training step, and it logs per step rather than giving one line an epoch.
    """

    def __init__(self) -> None:
        self._start = self._train_end = 0.0
        self._samples = 0

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # a run resumed mid-epoch gets no on_train_epoch_start for that epoch: time it from here
        self.on_train_epoch_start(trainer, pl_module)

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start = self._train_end = time.perf_counter()
        self._samples = 0

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        self._samples += len(batch[-1])
        self._train_end = time.perf_counter()

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        seconds = time.perf_counter() - self._start
        train_seconds = self._train_end - self._start
        # Every data-parallel replica processed the same number of batches of the same size.
        replicas, _ = data_replica(trainer.strategy)
        throughput = self._samples * replicas / max(train_seconds, 1e-9)
        pl_module.log("perf/samples_per_sec", float(throughput), on_epoch=True, sync_dist=True)
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("train/")}
        shown = "  ".join(f"{k}={v:.4f}" for k, v in sorted(metrics.items()))
        log.info(f"epoch {trainer.current_epoch}: {seconds:.2f} s, {throughput:,.0f} samples/s  {shown}")
