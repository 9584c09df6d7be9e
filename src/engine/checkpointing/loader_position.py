"""Whether a fit's training loaders keep their own position, which a mid-epoch resume needs.

The project's loaders and torchdata's ``StatefulDataLoader`` have ``state_dict``/``load_state_dict``: Lightning
saves where they stand and puts them back. A plain ``DataLoader`` has neither: resumed mid-epoch it would
start the epoch's shuffle again from its first batch.
"""

from __future__ import annotations

from typing import Any

import lightning as L


def train_loaders(trainer: L.Trainer) -> list[Any]:
    """This fit's training loaders (one, or the members of a list or dict of them)."""
    loaders = trainer.train_dataloader
    if isinstance(loaders, dict):
        return list(loaders.values())
    return list(loaders) if isinstance(loaders, (list, tuple)) else [loaders]


def keeps_position(loader: Any) -> bool:
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


def position_blocker(trainer: L.Trainer) -> str | None:
    """The first training loader that cannot resume mid-epoch, described (None: every one can)."""
    for loader in train_loaders(trainer):
        if loader is not None and not keeps_position(loader):
            source = trainer.datamodule if trainer.datamodule is not None else trainer.lightning_module
            return f"the training loader of {type(source).__name__} (a {type(loader).__name__})"
    return None
