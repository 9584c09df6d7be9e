"""Check a checkpoint against the model before any training starts."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from src.utils.errors import CheckpointError


def check_checkpoint(ckpt_path: str | os.PathLike, model: nn.Module) -> None:
    """Fail early, in one line, when ``ckpt_path`` is missing, unreadable or from another model.

    Lightning would only find out after launching processes and building the trainer,
    and a size mismatch surfaces there as a long ``load_state_dict`` traceback.
    """
    path = Path(ckpt_path)
    if not path.is_file():
        raise CheckpointError(f"ckpt_path={str(path)!r} does not exist: pass the path of a .ckpt file")
    if not os.access(path, os.R_OK):
        raise CheckpointError(f"ckpt_path={str(path)!r} is not readable: check its permissions")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)  # no code runs while loading
    except Exception as err:
        raise CheckpointError(f"cannot read checkpoint {path}: {type(err).__name__}: {err}") from err
    if not isinstance(state, dict) or "state_dict" not in state:
        raise CheckpointError(f"{path} is not a Lightning checkpoint (no 'state_dict' entry)")
    expected = model.state_dict()
    saved = state["state_dict"]
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    mismatched = [k for k in expected.keys() & saved.keys() if tuple(expected[k].shape) != tuple(saved[k].shape)]
    if missing or unexpected or mismatched:
        detail = "; ".join(
            f"{label}: {keys[:3]}{' ...' if len(keys) > 3 else ''}"
            for label, keys in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", sorted(mismatched)))
            if keys
        )
        raise CheckpointError(
            f"checkpoint {path} does not fit this model ({detail}); use the same model/data config it was trained with"
        )
