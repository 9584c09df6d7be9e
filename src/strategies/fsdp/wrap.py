"""Which modules FSDP2 shards: ``model.net``'s named blocks, the same blocks the pipeline splits on.

Each block with parameters becomes one ``fully_shard`` unit (its parameters are all-gathered together just
before it runs, and freed after), then ``net`` itself becomes the root unit. So any model that pipelines
also shards, and a block is the unit of both memory and communication.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from src.utils.errors import ConfigError

# trainer.strategy.sharding_strategy -> reshard_after_forward of each block (hybrid also replicates; see the strategy)
SHARDING_STRATEGIES = {"full": True, "grad_op": False, "hybrid": True}
_ALIASES = {"full_shard": "full", "shard_grad_op": "grad_op", "hybrid_shard": "hybrid"}  # Lightning's FSDP1 names


def resolve_sharding(name: Any) -> str:
    """``full``, ``grad_op`` or ``hybrid`` (FSDP1's ``FULL_SHARD``... are read too); a ConfigError otherwise."""
    key = _ALIASES.get(str(name).lower(), str(name).lower())
    if key not in SHARDING_STRATEGIES:
        raise ConfigError(f"trainer.strategy.sharding_strategy={name!r} is not a sharding strategy; fix: use "
                          "full (params, grads and optimizer state sharded), grad_op (params kept whole between "
                          "forward and backward) or hybrid (sharded within a group of ranks, replicated across them)")
    return key


def shard_units(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The named blocks of ``module.net`` that hold parameters (each one unit of sharding)."""
    return [(name, block) for name, block in module.net.named_children() if any(True for _ in block.parameters())]


def check_shardable(module: nn.Module) -> None:
    """One line for a model FSDP cannot shard by its blocks (before any rank starts)."""
    kind = type(module).__name__
    net = getattr(module, "net", None)
    if not isinstance(net, nn.Sequential):
        got = "none" if net is None else type(net).__name__
        raise ConfigError(f"trainer=fsdp shards model.net by its named blocks, so it must be an nn.Sequential; "
                          f"{kind}.net is {got}; fix: build the network as named blocks (see src/models/components/mlp.py)")
    if isinstance(net, FSDPModule):
        return  # sharded already (a second fit or test of the same module)
    if not shard_units(module):
        raise ConfigError(f"trainer=fsdp found no block with parameters to shard in model.net ({kind}); fix: give "
                          "the net named blocks holding its layers, or train with trainer=ddp")
    in_net = {id(p) for p in net.parameters()}
    outside = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in in_net]
    if outside:
        raise ConfigError(f"trainer=fsdp shards model.net only, and {kind} has trainable parameters outside it "
                          f"({outside[:3]}), which no rank would synchronise; fix: move them into net's blocks")
    if getattr(getattr(module, "hparams", None), "compile", False):
        raise ConfigError("trainer=fsdp shards the net after it is compiled in place, which FSDP2 does not follow; "
                          "fix: set model.compile=false")


def mixed_precision(precision: str) -> MixedPrecisionPolicy:
    """trainer.precision as FSDP2's policy: ``bf16-mixed`` gathers and computes in bf16, reduces gradients in
    float32; other precisions keep the parameters' own dtype (``*-true`` converts the model before sharding)."""
    if precision == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard_by_blocks(module: nn.Module, mesh: DeviceMesh, reshard_after_forward: bool, mp_policy: MixedPrecisionPolicy,
                    cpu_offload: bool) -> None:
    """``fully_shard`` every block of ``module.net`` with parameters, then ``net`` as the root unit."""
    options = {"mesh": mesh, "mp_policy": mp_policy,
               "offload_policy": CPUOffloadPolicy() if cpu_offload else OffloadPolicy()}
    for _, block in shard_units(module):
        fully_shard(block, reshard_after_forward=reshard_after_forward, **options)
    fully_shard(module.net, **options)  # torch's default for the root: kept whole after forward, backward needs it
