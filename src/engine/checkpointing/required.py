"""What makes a run resume exactly and stop cleanly: added to every ``fit`` by the entry point.

These are not a user's choice, so they are not in the ``callbacks`` group: ``callbacks=none`` or a
hand-picked list keeps them all. A Trainer built by hand gets the same by passing
``callbacks=[*mine, *resume_callbacks(run_dir)]``.
"""

from __future__ import annotations

from pathlib import Path

from lightning import Callback

from src.engine.checkpointing.continue_logs import ContinueLogs
from src.engine.checkpointing.epoch_restart import EpochRestartFix
from src.engine.checkpointing.last_checkpoint import LastCheckpoint
from src.engine.checkpointing.resume_state import ResumeMetricState, ResumeRandomState
from src.engine.checkpointing.step_limit import StopAtStepLimit
from src.engine.checkpointing.stop_signals import StopSignals
from src.engine.run.status import CHECKPOINT_DIR
from src.engine.utils.pylogger import RankedLogger

log = RankedLogger(__name__)
REQUIRED = (LastCheckpoint, ResumeRandomState, ResumeMetricState, EpochRestartFix, StopSignals, StopAtStepLimit,
            ContinueLogs)


def resume_callbacks(run_dir: str | Path, last_ckpt_every_n_train_steps: int = 1000) -> list[Callback]:
    """``last.ckpt`` (every N steps, each epoch's end, fit's end), every rank's random and metric state, the
    epoch-restart fix, one-process stop signals, a validated stop at ``max_steps``, and loggers that replace the
    rows a resume replays."""
    return [ResumeRandomState(), ResumeMetricState(), EpochRestartFix(), StopSignals(), StopAtStepLimit(), ContinueLogs(),
            LastCheckpoint(Path(run_dir) / CHECKPOINT_DIR, last_ckpt_every_n_train_steps)]


def with_resume_callbacks(chosen: list[Callback], run_dir: str | Path, every_n: int) -> list[Callback]:
    """The user's callbacks, then the required ones; a user's copy of a required one gives way to it."""
    kept = [cb for cb in chosen if not isinstance(cb, REQUIRED)]
    for cb in chosen:
        if isinstance(cb, REQUIRED):
            log.info(f"{type(cb).__name__} is always added by the entry point: the one in callbacks is left out")
    return [*kept, *resume_callbacks(run_dir, every_n)]
