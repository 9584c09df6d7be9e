"""Tell the loggers where a fit starts, so a resumed fit's replayed steps replace their earlier rows.

A resume replays the steps between its checkpoint and the kill. The first metrics a fit logs are the
first it replays: loggers that can rewrite their record (:mod:`src.engine.loggers.resumable`) drop what they
hold from that step on. Only a fit replays; validate and test add their rows.
"""

from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import Callback

from src.engine.utils.hooks import ReplaysLogs


class ContinueLogs(Callback):
    """At the start of each fit, arm every logger that has ``replay_starts``; disarm it when the fit ends."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for logger in trainer.loggers:
            if isinstance(logger, ReplaysLogs):
                logger.replay_starts(True)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for logger in trainer.loggers:
            if isinstance(logger, ReplaysLogs):
                logger.replay_starts(False)
