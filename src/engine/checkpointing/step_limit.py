"""``max_steps`` reached mid-epoch ends the run like any other stop: its last step is validated.

Lightning ends the epoch at ``max_steps`` without validating, then runs the epoch-end hooks: early
stopping (strict) fails for want of its metric, and the best checkpoint misses the last steps. Lightning
validates before a stop it is asked for (``trainer.should_stop``, as early stopping and the Timer behind
``max_time`` ask) once ``min_epochs``/``min_steps`` are met, so at the step that reaches ``max_steps``
this callback asks for a stop and lifts those minimums: the run ends there anyway (``max_steps`` wins in
Lightning's fit loop), and the minimums would only skip that validation. Every rank counts the same
steps, so every rank asks at once.
"""

from __future__ import annotations

from typing import Any

from lightning import Callback, LightningModule, Trainer


class StopAtStepLimit(Callback):
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if 0 <= trainer.max_steps <= trainer.global_step:
            trainer.fit_loop.min_epochs = None
            trainer.fit_loop.epoch_loop.min_steps = None
            trainer.should_stop = True
