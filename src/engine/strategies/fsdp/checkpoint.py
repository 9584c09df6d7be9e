"""A sharded model's weights and optimizer state, to and from either checkpoint format.

*Sharded* (the default): every rank saves and loads its own shards through ``torch.distributed.checkpoint``
(:mod:`src.engine.checkpointing.sharded`); the folder reshards on load, so it resumes on any number of ranks.
*Full*: the weights and optimizer state are gathered to global rank 0 and written as one file, laid out
as a DDP or single-device checkpoint (optimizer state in torch's format, each group listing its
``param_names``); every rank reads that file and keeps its own shards.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

from src.engine.checkpointing.io import load_checkpoint_file
from src.engine.checkpointing.optimizer_state import (
    indexed_optimizer_state,
    named_optimizer_state,
    names_in_order,
)
from src.engine.checkpointing.sharded import (
    from_layout,
    is_sharded_checkpoint,
    load_sharded,
    read_meta,
    to_layout,
)
from src.engine.utils.errors import CheckpointError

GATHERED = StateDictOptions(full_state_dict=True, cpu_offload=True)  # whole tensors, on global rank 0's host only


def model_state(model: nn.Module, full: bool) -> dict[str, Any]:
    """This rank's shards of the weights, or (``full``) the whole weights on global rank 0 and ``{}`` elsewhere."""
    return get_model_state_dict(model, options=GATHERED if full else None)


def optimizer_state(model: nn.Module, optimizer: Optimizer, full: bool, is_global_zero: bool) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name (shards), or (``full``) whole in torch's format on rank 0."""
    if not full:
        return get_optimizer_state_dict(model, optimizer)
    state = get_optimizer_state_dict(model, optimizer, options=GATHERED)
    return indexed_optimizer_state(state) if is_global_zero else {}


def load_into(model: nn.Module, optimizers: list[Optimizer], path: str | Path, strict: bool) -> dict[str, Any]:
    """Load a sharded folder or a full file into the sharded ``model`` and ``optimizers`` (every rank calls it).

    Returns the rest of the checkpoint (loops, callbacks, ...), as Lightning's strategies do.
    """
    sharded = is_sharded_checkpoint(path)
    if sharded:
        live = {"state_dict": get_model_state_dict(model),
                "optimizer_states": [get_optimizer_state_dict(model, o) for o in optimizers]}
        targets, _ = to_layout(live)  # this rank's shards, read in place
        try:
            load_sharded(targets, path)
        except CheckpointException as err:
            detail = str(err).strip().splitlines()[-1][:300]
            raise CheckpointError(f"{path} does not fit this model and optimizer ({detail}); fix: resume with the "
                                  "model, optimizer and data config it was trained with") from None
        checkpoint = from_layout(targets, read_meta(path))
    else:
        checkpoint = load_checkpoint_file(path)
        checkpoint["optimizer_states"] = [named_optimizer_state(s, names_in_order(o, model))
                                          for s, o in zip(checkpoint.get("optimizer_states", []), optimizers, strict=False)]
    options = StateDictOptions(full_state_dict=not sharded, strict=strict)
    set_model_state_dict(model, checkpoint.pop("state_dict"), options=options)
    states = checkpoint.pop("optimizer_states", [])
    if len(states) < len(optimizers):
        raise CheckpointError(f"{path} holds no optimizer state (a weights-only checkpoint); fix: resume from a "
                              "last.ckpt or epoch_*.ckpt, or pass it to src/eval.py instead")
    for optimizer, state in zip(optimizers, states, strict=False):
        load_optimizer(model, optimizer, state, full=not sharded)
    return checkpoint


# How a step runs, not what it has learned: chosen for the live optimizer's (sharded) parameters when it was
# built, e.g. no fused SGD on DTensors (src/engine/steps/optimizers.py). A saved group's choice is not restored.
IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable")


def load_optimizer(model: nn.Module, optimizer: Optimizer, state: dict[str, Any], full: bool) -> None:
    """``set_optimizer_state_dict``, keeping the live optimizer's implementation choices. An optimizer with no
    per-parameter state (SGD without momentum) gets its groups' settings only: torch's full-state loader has no
    tensor to place and fails on it."""
    stateless = not state.get("state")
    for saved, live in zip(state.get("param_groups", []), optimizer.param_groups, strict=False):
        saved.update({key: live[key] for key in IMPLEMENTATION_KEYS if key in live})
        if stateless:
            live.update({key: value for key, value in saved.items() if key not in ("params", "param_names")})
    if not stateless:
        set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=full))
