"""K-fold cross-validation splits of a training set: disjoint, covering, stratified by class, seeded."""

from __future__ import annotations

import torch
from torch import Tensor

from src.engine.utils.errors import ConfigError


def check_fold(n_folds: int | None, fold: int) -> None:
    if n_folds is None:
        return
    if not isinstance(n_folds, int) or n_folds < 2:
        raise ConfigError(f"data.n_folds={n_folds!r} must be an integer >= 2; fix: set it, or null for one "
                          "validation split of data.val_size samples")
    if not isinstance(fold, int) or not 0 <= fold < n_folds:
        raise ConfigError(f"data.fold={fold!r} must be an integer in 0..{n_folds - 1}; fix: pick one, or run them all "
                          "with hparams_search=kfold")


def stratified_folds(targets: Tensor, n_folds: int, seed: int) -> list[Tensor]:
    """``n_folds`` sorted index tensors, disjoint and covering ``range(len(targets))``.

    Each class's indices are shuffled with ``seed`` and dealt in turn to the folds, starting where the
    previous class stopped, so every fold holds each class's share within one sample and fold sizes differ
    by at most one. Targets that are not class indices (regression) are dealt as one class.
    """
    generator = torch.Generator().manual_seed(seed)
    classes = targets.unique(sorted=True) if not targets.is_floating_point() and targets.dim() == 1 else None
    groups = [(targets == c).nonzero().flatten() for c in classes] if classes is not None else [
        torch.arange(len(targets))]
    folds: list[list[Tensor]] = [[] for _ in range(n_folds)]
    start = 0
    for group in groups:
        shuffled = group[torch.randperm(len(group), generator=generator)]
        for k in range(n_folds):
            folds[(start + k) % n_folds].append(shuffled[k::n_folds])
        start = (start + len(group)) % n_folds
    return [torch.cat(parts).sort().values for parts in folds]
