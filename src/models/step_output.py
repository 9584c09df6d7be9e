"""What ``model_step`` returns, in a module of its own: the strategies that run the steps import it.

It imports nothing from the project, so ``src.strategies`` (imported by ``step_module``) can import it
back without a cycle.
"""

from __future__ import annotations

from typing import TypedDict

from torch import Tensor


class StepOutput(TypedDict):
    loss: Tensor  # mean loss over the samples of this (sub-)batch
    output: Tensor  # network output, one row per sample
    target: Tensor
