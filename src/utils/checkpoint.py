"""Check a checkpoint against the model before any training starts."""

from __future__ import annotations

import os
import pickle
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
    state = load_checkpoint_file(path)
    if not isinstance(state, dict) or "state_dict" not in state:
        raise CheckpointError(
            f"{path} is not a Lightning checkpoint (no 'state_dict' entry); fix: pass a .ckpt file saved by "
            "Lightning (checkpoints/last.ckpt or epoch_*.ckpt of a run)"
        )
    expected = model.state_dict()
    saved = state["state_dict"]
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    mismatched = [
        k for k in expected.keys() & saved.keys() if tuple(expected[k].shape) != tuple(saved[k].shape)
    ]
    if missing or unexpected or mismatched:
        detail = "; ".join(
            f"{label}: {keys[:3]}{' ...' if len(keys) > 3 else ''}"
            for label, keys in (
                ("missing", missing),
                ("unexpected", unexpected),
                ("shape mismatch", sorted(mismatched)),
            )
            if keys
        )
        raise CheckpointError(
            f"checkpoint {path} does not fit this model ({detail}); use the same model/data config it was trained with"
        )


def load_checkpoint_file(path: Path) -> object:
    """``torch.load(path, weights_only=True)``; a :class:`CheckpointError` of one line naming the problem and a fix.

    torch's own messages span many lines, and for a file it cannot unpickle suggest ``weights_only=False``,
    which would let a crafted file run code: never the fix here.
    """
    shown = f"ckpt_path={str(path)!r}"
    if not path.exists():
        raise CheckpointError(f"{shown} does not exist; fix: pass the path of a .ckpt file")
    if path.is_dir():
        inside = sorted(p.name for p in path.glob("*.ckpt"))[:3]
        example = path / (inside[0] if inside else "last.ckpt")
        holds = f" (it holds {', '.join(inside)})" if inside else ""
        raise CheckpointError(
            f"{shown} is a directory, not a checkpoint file{holds}; fix: pass a file, e.g. "
            f"ckpt_path={example}"
        )
    if not path.is_file():
        raise CheckpointError(f"{shown} is not a regular file; fix: pass the path of a .ckpt file")
    if not os.access(path, os.R_OK):
        raise CheckpointError(f"{shown} is not readable: check its permissions")
    if path.stat().st_size == 0:
        raise CheckpointError(
            f"checkpoint {path} is empty (0 bytes; its save was cut short); fix: use another "
            f"checkpoint, e.g. an epoch_*.ckpt beside it, or train again"
        )
    try:
        return torch.load(path, map_location="cpu", weights_only=True)  # no code runs while loading
    except pickle.UnpicklingError as err:
        detail = _unpickling_detail(str(err))
        if detail.startswith("Unsupported global"):
            raise CheckpointError(
                f"cannot read checkpoint {path}: it holds Python objects other than weights "
                f"({detail}); fix: use a checkpoint saved by this project, whose files load "
                "as plain weights"
            ) from None
        raise CheckpointError(
            f"cannot read checkpoint {path}: the file is corrupt or not a PyTorch checkpoint "
            f"({detail}); fix: use another checkpoint, e.g. an epoch_*.ckpt beside it"
        ) from None
    except Exception as err:
        detail = _first_sentence(str(err)) or type(err).__name__
        raise CheckpointError(
            f"cannot read checkpoint {path}: the file is corrupt or truncated ({detail}); "
            "fix: use another checkpoint, e.g. an epoch_*.ckpt beside it"
        ) from None


def _unpickling_detail(message: str) -> str:
    """The reason inside torch's weights-only unpickling message, without its advice."""
    _, found, after = message.partition("WeightsUnpickler error:")
    return _first_sentence(after if found else message) or "unreadable pickle data"


def _first_sentence(message: str) -> str:
    first = next((line.strip() for line in message.splitlines() if line.strip()), "")
    return first.split(". ")[0].rstrip(".")[:200]
