"""What a step module's ``model_step`` returns (its own module: the step machinery and the strategies read it)."""

from __future__ import annotations

from typing import TypedDict

from torch import Tensor


class StepOutput(TypedDict):
    """What ``model_step`` returns; the dp and pipeline strategies gather and pass it to ``record_step``."""

    loss: Tensor  # mean loss over the samples of this (sub-)batch
    output: Tensor  # network output, one row per sample
    target: Tensor
