"""Normalization and augmentation applied to whole batches, on whatever device the batch is on.

torchvision's per-sample transforms (``RandomCrop``, ``RandomHorizontalFlip``) cannot draw a
different crop for every image of a batched tensor in one call, so the crop is written
here as one gather with per-sample offsets.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor


def to_unit_float(images: Tensor) -> Tensor:
    """uint8 images in [0, 255] to float32 in [0, 1]."""
    return images.float().div_(255.0)


def normalize(images: Tensor, mean: Sequence[float], std: Sequence[float]) -> Tensor:
    """Per-channel ``(x - mean) / std`` for an ``(N, C, H, W)`` float batch (a new tensor; ``images`` is kept)."""
    mean_t, std_t = _channel_stats(tuple(mean), tuple(std), images.dtype, images.device)
    return images.sub(mean_t).div_(std_t)


@functools.lru_cache(maxsize=32)
def _channel_stats(mean: tuple, std: tuple, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
    """``mean`` and ``std`` as ``(1, C, 1, 1)`` tensors, built once per dtype/device instead of on every batch."""
    shape = (1, -1, 1, 1)
    return (torch.as_tensor(mean, dtype=dtype, device=device).view(shape),
            torch.as_tensor(std, dtype=dtype, device=device).view(shape))


def random_crop(images: Tensor, padding: int, generator: torch.Generator | None = None,
                fill: Tensor | None = None) -> Tensor:
    """Pad by ``padding`` and crop back to the original size at an independent random offset per image.

    The border is 0, or ``fill`` per channel (shape ``(1, C, 1, 1)``): the value of a black pixel after
    normalization, which makes cropping a normalized batch equal to normalizing a cropped one.
    """
    n, c, h, w = images.shape
    if fill is None:
        padded = F.pad(images, (padding, padding, padding, padding))
    else:
        padded = fill.expand(n, c, h + 2 * padding, w + 2 * padding).clone()
        padded[:, :, padding:padding + h, padding:padding + w] = images
    off_y = torch.randint(0, 2 * padding + 1, (n, 1), device=images.device, generator=generator)
    off_x = torch.randint(0, 2 * padding + 1, (n, 1), device=images.device, generator=generator)
    rows = (off_y + torch.arange(h, device=images.device))[:, :, None]  # (N, H, 1)
    cols = (off_x + torch.arange(w, device=images.device))[:, None, :]  # (N, 1, W)
    batch = torch.arange(n, device=images.device)[:, None, None]
    # Advanced indexing on dims 0, 2, 3 puts the channel dim last: (N, H, W, C).
    return padded[batch, :, rows, cols].permute(0, 3, 1, 2).contiguous()


def random_hflip(images: Tensor, p: float = 0.5, generator: torch.Generator | None = None) -> Tensor:
    """Mirror each image horizontally with probability ``p``."""
    flip = torch.rand(images.shape[0], device=images.device, generator=generator) < p
    return torch.where(flip[:, None, None, None], images.flip(3), images)
