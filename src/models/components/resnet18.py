"""ResNet-18 with a CIFAR-style stem (3x3 conv, stride 1, no max-pool) for 28-32 px images."""

from __future__ import annotations

from collections import OrderedDict

from torch import nn
from torchvision.models import resnet18


class ResNet18(nn.Sequential):
    """torchvision's ResNet-18 re-cut into named blocks: ``stem, layer1..layer4, head``.

    The ImageNet stem (7x7 stride-2 conv + max-pool) throws away most of a 32x32
    image, so it is replaced by a 3x3 stride-1 conv. The blocks are the pipeline
    strategy's split points.
    """

    capture_safe = True  # its forward may run inside a captured step (src/engine/steps/step_capture.py)

    def __init__(self, in_channels: int = 3, num_classes: int = 10, image_size: int = 32) -> None:
        del image_size  # accepted so every net takes the same data-derived arguments
        base = resnet18(weights=None, num_classes=num_classes)
        stem = nn.Sequential(
            nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False),
            base.bn1,
            base.relu,
        )
        head = nn.Sequential(base.avgpool, nn.Flatten(), base.fc)
        super().__init__(
            OrderedDict(
                stem=stem, layer1=base.layer1, layer2=base.layer2, layer3=base.layer3, layer4=base.layer4, head=head
            )
        )
