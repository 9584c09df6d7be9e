"""Optimizer state keyed by parameter name, and back to torch's numbered format.

torch's ``Optimizer.state_dict()`` numbers parameters in group order, and that numbering stops meaning
anything once a model is sharded (fsdp) or split into stages (pipeline). Both keep optimizer state keyed
by parameter name (the layout of ``torch.distributed.checkpoint.state_dict``: ``{"state": {name: ...},
"param_groups": [{..., "params": [names]}]}``) while they gather, merge or reshard it, and write a full
checkpoint in torch's format with each group's ``param_names``, so that one file loads on one device,
under ddp, fsdp or a pipeline.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.optim import Optimizer

from src.engine.utils.errors import CheckpointError


def group_names(optimizer: Optimizer, module: nn.Module) -> list[list[str]]:
    """The qualified names of each of ``optimizer``'s param groups' parameters in ``module``, in order."""
    name_of = {id(p): name for name, p in module.named_parameters()}
    return [[name_of[id(p)] for p in group["params"]] for group in optimizer.param_groups]


def names_in_order(optimizer: Optimizer, module: nn.Module) -> list[str]:
    """The names of ``optimizer``'s parameters in group order: how ``optimizer.state_dict()`` numbers them."""
    return [name for group in group_names(optimizer, module) for name in group]


def indexed_optimizer_state(named: dict[str, Any], param_names: bool = True) -> dict[str, Any]:
    """torch's format (parameters numbered in group order) of a name-keyed state; with ``param_names`` each
    group also lists its parameters' names, which torch keeps and a later load can match by."""
    index: dict[str, int] = {}
    groups = []
    for group in named["param_groups"]:
        names = list(group["params"])
        index.update({name: len(index) + i for i, name in enumerate(names)})
        groups.append({**group, "params": [index[n] for n in names], **({"param_names": names} if param_names else {})})
    return {"state": {index[n]: s for n, s in named["state"].items()}, "param_groups": groups}


def named_optimizer_state(indexed: dict[str, Any], names_in_order: list[str]) -> dict[str, Any]:
    """The inverse of :func:`indexed_optimizer_state`. A group without ``param_names`` (saved by one device or
    ddp, or a live ``optimizer.state_dict()``) is read in ``names_in_order``: the names of the optimizer's
    parameters in group order."""
    name_of: dict[int, str] = {}
    groups = []
    for group in indexed["param_groups"]:
        names = group.get("param_names") or names_in_order[len(name_of):len(name_of) + len(group["params"])]
        if len(names) != len(group["params"]):
            raise CheckpointError("the checkpoint's optimizer state does not fit this model; fix: resume with the "
                                  "model and optimizer config it was trained with")
        name_of.update(zip(group["params"], names, strict=True))
        groups.append({**{k: v for k, v in group.items() if k != "param_names"}, "params": list(names)})
    return {"state": {name_of[i]: s for i, s in indexed["state"].items()}, "param_groups": groups}
