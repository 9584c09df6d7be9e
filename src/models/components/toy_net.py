"""The toy regression network from the DDP tutorial: 10 -> 10 -> ReLU -> 5."""

from __future__ import annotations

from collections import OrderedDict

from torch import nn


class ToyNet(nn.Sequential):
    """Two linear blocks (``net1`` with its ReLU, then ``net2``): the smallest model with two pipeline stages."""

    capture_safe = True  # its forward may run inside a captured step (src/engine/steps/step_capture.py)

    def __init__(self, in_features: int = 10, hidden: int = 10, out_features: int = 5) -> None:
        super().__init__(
            OrderedDict(
                net1=nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU()),
                net2=nn.Linear(hidden, out_features),
            )
        )
