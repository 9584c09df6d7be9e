"""Multi-layer perceptron over flattened images, built as named sequential blocks."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from torch import nn


class MLP(nn.Sequential):
    """``fc0 .. fc{k-1}`` (Linear, BatchNorm?, ReLU, Dropout) then ``head`` (Linear).

    Being an ``nn.Sequential`` with named children is the contract the pipeline
    strategy relies on: the children are the ordered blocks it may split between stages.
    """

    capture_safe = True  # its forward may run inside a captured step (src/engine/steps/step_capture.py)

    def __init__(
        self,
        in_channels: int = 1,
        image_size: int = 28,
        hidden_sizes: Sequence[int] = (512, 256),
        num_classes: int = 10,
        dropout: float = 0.1,
        batch_norm: bool = False,
    ) -> None:
        if not hidden_sizes:
            raise ValueError("MLP needs at least one hidden layer: set model.net.hidden_sizes, e.g. [512, 256]")
        blocks: OrderedDict[str, nn.Module] = OrderedDict()
        width = in_channels * image_size * image_size
        for i, size in enumerate(hidden_sizes):
            layers = [nn.Flatten()] if i == 0 else []
            layers.append(nn.Linear(width, size, bias=not batch_norm))  # BatchNorm's shift replaces the bias
            if batch_norm:
                layers.append(nn.BatchNorm1d(size))
            layers.append(nn.ReLU(inplace=True))
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            blocks[f"fc{i}"] = nn.Sequential(*layers)
            width = size
        blocks["head"] = nn.Linear(width, num_classes)
        super().__init__(blocks)
