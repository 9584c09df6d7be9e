"""Normalization and augmentation applied to whole batches, on whatever device the batch is on.

torchvision's per-sample transforms (``RandomCrop``, ``RandomHorizontalFlip``) cannot draw a
different crop for every image of a batched tensor in one call, so the crop is written
here as one gather with per-sample offsets.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor


def to_unit_float(images: Tensor) -> Tensor:
    """uint8 images in [0, 255] to float32 in [0, 1]."""
    return images.float().div_(255.0)


def normalize(images: Tensor, mean: Sequence[float], std: Sequence[float]) -> Tensor:
    """Per-channel ``(x - mean) / std`` for an ``(N, C, H, W)`` float batch."""
    shape = (1, -1, 1, 1)
    mean_t = torch.as_tensor(mean, dtype=images.dtype, device=images.device).view(shape)
    std_t = torch.as_tensor(std, dtype=images.dtype, device=images.device).view(shape)
    return (images - mean_t) / std_t


def random_crop(images: Tensor, padding: int) -> Tensor:
    """Zero-pad by ``padding`` and crop back to the original size at an independent random offset per image."""
    n, _, h, w = images.shape
    padded = F.pad(images, (padding, padding, padding, padding))
    off_y = torch.randint(0, 2 * padding + 1, (n, 1), device=images.device)
    off_x = torch.randint(0, 2 * padding + 1, (n, 1), device=images.device)
    rows = (off_y + torch.arange(h, device=images.device))[:, :, None]  # (N, H, 1)
    cols = (off_x + torch.arange(w, device=images.device))[:, None, :]  # (N, 1, W)
    batch = torch.arange(n, device=images.device)[:, None, None]
    # Advanced indexing on dims 0, 2, 3 puts the channel dim last: (N, H, W, C).
    return padded[batch, :, rows, cols].permute(0, 3, 1, 2).contiguous()


def random_hflip(images: Tensor, p: float = 0.5) -> Tensor:
    """Mirror each image horizontally with probability ``p``."""
    flip = torch.rand(images.shape[0], device=images.device) < p
    return torch.where(flip[:, None, None, None], images.flip(3), images)
