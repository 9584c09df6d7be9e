"""One full-model checkpoint from a split model: gather every stage's state, and take a stage's share back.

*Saving.* Each rank's ``state_dict`` already carries the original keys (``net.<block>...``)
because the strategy only deletes the other ranks' blocks from ``net``. Pipeline rank 0 of
each replica gathers the other stages' entries with ``gather_object`` (CPU tensors, pickled:
fine for models of this template's size; a multi-GB model would want
``torch.distributed.checkpoint`` instead) and merges them into the state dict of the unsplit
model, which loads on a single device.

*Optimizer state* is saved the same way: every stage's optimizer state is re-keyed by
parameter *name*, merged, and renumbered in the unsplit model's parameter order. The result
is a standard ``torch.optim`` state dict (each group also lists its ``param_names``), so a
pipeline checkpoint resumes on one device too; on a pipeline resume every rank picks its own
parameters' entries by name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch import nn
from torch.optim import Optimizer

from src.engine.checkpointing.optimizer_state import (
    group_names,
    indexed_optimizer_state,
    named_optimizer_state,
    names_in_order,
)
from src.engine.strategies.pipeline.mesh import PipelineMesh
from src.engine.utils.errors import CheckpointError


def gather_to_first_stage(obj: Any, mesh: PipelineMesh) -> list[Any] | None:
    """``obj`` from every rank of this pipeline, ordered by pipeline rank, on pipeline rank 0 (else ``None``)."""
    obj = move_data_to_device(obj, "cpu")
    if mesh.layout.pp == 1:
        return [obj]
    out: list[Any] | None = [None] * mesh.layout.pp if mesh.is_first else None
    dst = mesh.layout.global_rank(mesh.dp_rank, 0)
    dist.gather_object(obj, out, dst=dst, group=mesh.pp_group)
    return out


def block_order_key(block_order: Sequence[str]) -> Callable[[str], int]:
    """Sort key putting ``net.<block>...`` names in the unsplit net's block order (other keys first)."""
    position = {name: i for i, name in enumerate(block_order)}

    def key(name: str) -> int:
        parts = name.split(".")
        return position.get(parts[1], -1) + 1 if len(parts) > 1 and parts[0] == "net" else 0

    return key


def merge_state_dicts(parts: Iterable[dict[str, Any]], block_order: Sequence[str]) -> dict[str, Any]:
    """Union of the stages' state dicts, keys in the unsplit model's order (stable within a block)."""
    merged: dict[str, Any] = {}
    for part in parts:
        for name, value in part.items():
            merged.setdefault(name, value)
    key = block_order_key(block_order)
    return {name: merged[name] for name in sorted(merged, key=key)}


def merge_optimizer_states(parts: Sequence[dict[str, Any]], block_order: Sequence[str]) -> dict[str, Any]:
    """Merge name-keyed stage states into one state dict of the unsplit model's optimizer (torch's format)."""
    n_groups = {len(p["param_groups"]) for p in parts}
    if len(n_groups) != 1:
        raise CheckpointError(f"the stages' optimizers have different numbers of param groups ({sorted(n_groups)}); fix: give every "
                              "parameter group to every stage (one optimizer config for the whole model)")
    key = block_order_key(block_order)
    groups = [  # stable sort: parameters of one block keep their order within the stage that holds it
        {**parts[0]["param_groups"][g], "params": sorted((n for p in parts for n in p["param_groups"][g]["params"]), key=key)}
        for g in range(n_groups.pop())
    ]
    state = {n: s for p in parts for n, s in p["state"].items()}
    order = [n for g in groups for n in g["params"]]
    return indexed_optimizer_state({"state": {n: state[n] for n in order if n in state}, "param_groups": groups})


def local_optimizer_state(
    full: dict[str, Any], local_groups: Sequence[Sequence[str]], fallback_names: Sequence[str]
) -> dict[str, Any]:
    """This rank's share of a full-model optimizer state dict, as its own optimizer's state dict.

    Parameters are matched by the ``param_names`` saved in each group. A state dict without
    names (saved by a single-device or DDP run) is read in the unsplit model's parameter order
    (``fallback_names``), which only identifies parameters when there is a single group.
    """
    groups = full.get("param_groups", [])
    if len(groups) != len(local_groups):
        raise CheckpointError(
            f"the checkpoint's optimizer has {len(groups)} param groups, this run's has {len(local_groups)}; fix: "
            f"resume with the optimizer config the checkpoint was trained with"
        )
    if len(groups) > 1 and any("param_names" not in g for g in groups):
        raise CheckpointError("the checkpoint's optimizer state has several groups and no parameter names: "
                              "it cannot be split across pipeline stages; fix: resume it on one device or under ddp")
    named = named_optimizer_state(full, list(fallback_names))
    known = {n for g in named["param_groups"] for n in g["params"]}
    missing = [n for names in local_groups for n in names if n not in known]
    if missing:
        raise CheckpointError(f"the checkpoint has no optimizer state for {missing[:3]}: it was saved from "
                              f"another model; fix: pass that model's config")
    local_names = [n for names in local_groups for n in names]
    local = {"state": {n: named["state"][n] for n in local_names if n in named["state"]},
             "param_groups": [{**g, "params": list(names)} for g, names in zip(named["param_groups"], local_groups, strict=True)]}
    return indexed_optimizer_state(local, param_names=False)


# -- what the strategy's checkpoint hooks call ------------------------------------------------------
def full_model_state(module: nn.Module, mesh: PipelineMesh, block_order: Sequence[str]) -> dict[str, Any]:
    """The unsplit model's state dict on pipeline rank 0 of each replica (``{}`` on the other stages)."""
    parts = gather_to_first_stage(module.state_dict(), mesh)
    return merge_state_dicts(parts, block_order) if parts is not None else {}


def full_optimizer_state(optimizer: Optimizer, module: nn.Module, mesh: PipelineMesh,
                         block_order: Sequence[str]) -> dict[str, Any]:
    """The unsplit model's optimizer state on pipeline rank 0 of each replica (``{}`` elsewhere)."""
    named = named_optimizer_state(optimizer.state_dict(), names_in_order(optimizer, module))
    parts = gather_to_first_stage(named, mesh)
    return merge_optimizer_states(parts, block_order) if parts is not None else {}


def load_local_model_state(module: nn.Module, state: dict[str, Any], strict: bool) -> None:
    """Load this rank's blocks (and the module's other entries) from a full-model state dict."""
    local = module.state_dict().keys()
    missing = [k for k in local if k not in state]
    if missing and strict:
        raise CheckpointError(f"the checkpoint lacks {missing[:3]}: it was saved from another model; fix: pass that model's config")
    module.load_state_dict({k: state[k] for k in local if k in state}, strict=strict)


def load_local_optimizer_states(optimizers: Sequence[Optimizer], full_states: Sequence[dict[str, Any]],
                                module: nn.Module, full_param_names: Sequence[str]) -> None:
    """Give each of this rank's optimizers its own parameters' entries of the full-model states."""
    for optimizer, full in zip(optimizers, full_states, strict=True):
        optimizer.load_state_dict(local_optimizer_state(full, group_names(optimizer, module), full_param_names))
