"""A bench-only Lightning callback that records the project's training timeline.

Added on the command line, not in any config:
``+callbacks.bench_timer._target_=scripts.bench.step_timer.StepTimer +callbacks.bench_timer.prefix=<path>``.
"""

from __future__ import annotations

import multiprocessing

from lightning import Callback, LightningModule, Trainer

from scripts.bench.timeline import Timeline, rank_path


class StepTimer(Callback):
    """Stamps each training epoch start and batch end, and the end of training, into a :class:`Timeline`.

    One file per rank. The end stamp closes the last epoch (validation and its checkpoint included):
    Lightning calls checkpoint callbacks last, so ``last.ckpt``'s extra save at ``on_train_end`` is not in it.
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.timeline: Timeline | None = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.timeline is None:
            self.timeline = Timeline(rank_path(self.prefix, trainer.global_rank), rank=trainer.global_rank,
                                     cuda=trainer.strategy.root_device.type == "cuda")

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.timeline.epoch_start()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        self.timeline.step_end(len(batch[-1]), last=batch_idx + 1 == trainer.num_training_batches)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.timeline.epoch_end()
        if multiprocessing.parent_process() is not None:  # a spawned or forked rank ends without atexit handlers
            self.timeline.dump()

    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.timeline.meta["test_metrics"] = {k: float(v) for k, v in trainer.callback_metrics.items()
                                              if k.startswith("test/")}
