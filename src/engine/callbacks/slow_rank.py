"""A test-only callback: a fixed delay per training step (longer on chosen ranks), and each step's end time.

Used by ``tests/test_ps.py`` and ``python -m scripts.studies.ps_vs_ddp`` to slow one rank down on purpose.
The delay (a sleep before every batch) dominates the step time, so rates compare on a loaded machine:

    python src/train.py trainer=ps trainer.devices=4 +callbacks.slow._target_=src.engine.callbacks.slow_rank.SlowRank \\
        +callbacks.slow.delay_s=0.02 +callbacks.slow.slow_ranks=[3]

Every rank keeps ``step_times/rank<r>.json`` (its step end times, ``time.monotonic``) in the run directory,
rewritten after each step: under ``trainer=ps`` the chief may end the job while a worker is still in a step.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import Callback


class SlowRank(Callback):
    """Sleep ``delay_s`` before every training batch, ``factor`` times as long on ``slow_ranks``."""

    def __init__(self, delay_s: float, slow_ranks: Sequence[int] = (), factor: float = 4.0) -> None:
        self.delay_s, self.slow_ranks, self.factor = delay_s, set(slow_ranks), factor
        self.ends: list[float] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if getattr(trainer.strategy, "is_server", False):
            return  # a parameter server's steps are its clock, not work
        time.sleep(self.delay_s * (self.factor if trainer.global_rank in self.slow_ranks else 1.0))

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch,
                           batch_idx: int) -> None:
        self.ends.append(time.monotonic())
        out = Path(trainer.default_root_dir) / "step_times"
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / f".rank{trainer.global_rank}.json.tmp"
        tmp.write_text(json.dumps(self.ends))
        os.replace(tmp, out / f"rank{trainer.global_rank}.json")  # a reader never sees half a file


def step_rate(ends: Sequence[float], skip: int = 3) -> float:
    """Steps per second between the ``skip``-th and the last step (the first steps include start-up)."""
    ends = list(ends)[skip:]
    return (len(ends) - 1) / (ends[-1] - ends[0]) if len(ends) > 1 and ends[-1] > ends[0] else 0.0


def read_rates(run_dir: Path) -> dict[int, float]:
    """``{rank: steps per second}`` from the files :class:`SlowRank` wrote."""
    return {int(p.stem.removeprefix("rank")): step_rate(json.loads(p.read_text()))
            for p in sorted((Path(run_dir) / "step_times").glob("rank*.json"))}
