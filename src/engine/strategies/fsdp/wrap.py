"""Which modules FSDP2 shards: a wrap policy picks the units inside the LightningModule's submodules.

Every top-level submodule of the LightningModule that holds parameters is a *root* unit (``net``; or a
GAN's ``generator`` and ``discriminator``; or BoringModel's ``layer``). Inside each root, the policy picks
the inner units, each its own ``fully_shard`` call (its parameters all-gathered together just before it
runs, and freed after), applied innermost first; the root holds what no inner unit took. As Lightning's
FSDP and torchtitan do, the policy is one of (``trainer.strategy.wrap``):

* ``blocks``: the named blocks of an ``nn.Sequential`` ``net`` (the blocks the pipeline splits on);
* ``size``: torch's size-based policy: a submodule whose parameters not yet in a unit below it number at least
  ``trainer.strategy.wrap_min_params`` (a layer, or a container of small layers);
* a list of classes (``[torch.nn.Linear]``, ``[TransformerBlock]``: an import path, or a class name the model
  has): every submodule of one of those classes;
* ``auto`` (the default): ``blocks`` when the module holds an ``nn.Sequential`` ``net`` with parameters, else
  ``size``.

Whatever the policy, every parameter ends up sharded (a root unit shards what its inner units left), so each
rank holds 1/N of the parameters, gradients and optimizer state; the policy sets how much is gathered at once.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from dataclasses import dataclass
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

from src.engine.utils.errors import ConfigError

# trainer.strategy.sharding_strategy -> reshard_after_forward of each block (hybrid also replicates; see the strategy)
SHARDING_STRATEGIES = {"full": True, "grad_op": False, "hybrid": True}
_ALIASES = {"full_shard": "full", "shard_grad_op": "grad_op", "hybrid_shard": "hybrid"}  # Lightning's FSDP1 names

WRAP_POLICIES = ("auto", "blocks", "size")  # or a list of classes
DEFAULT_MIN_PARAMS = 100_000  # size policy: a unit gathers at least this many parameters (400 kB in float32)


def resolve_sharding(name: Any) -> str:
    """``full``, ``grad_op`` or ``hybrid`` (FSDP1's ``FULL_SHARD``... are read too); a ConfigError otherwise."""
    key = _ALIASES.get(str(name).lower(), str(name).lower())
    if key not in SHARDING_STRATEGIES:
        raise ConfigError(f"trainer.strategy.sharding_strategy={name!r} is not a sharding strategy; fix: use "
                          "full (params, grads and optimizer state sharded), grad_op (params kept whole between "
                          "forward and backward) or hybrid (sharded within a group of ranks, replicated across them)")
    return key


@dataclass(frozen=True)
class WrapPolicy:
    """``kind`` is ``auto``, ``blocks``, ``size`` or ``classes`` (then ``classes`` names them)."""

    kind: str = "auto"
    classes: tuple[str, ...] = ()
    min_params: int = DEFAULT_MIN_PARAMS

    def __str__(self) -> str:
        return f"[{', '.join(self.classes)}]" if self.kind == "classes" else self.kind


AUTO = WrapPolicy()
BLOCKS = WrapPolicy("blocks")


def resolve_wrap(wrap: Any = "auto", min_params: Any = DEFAULT_MIN_PARAMS) -> WrapPolicy:
    """``trainer.strategy.wrap`` and ``wrap_min_params`` as a policy; a ConfigError for anything else."""
    if isinstance(min_params, bool) or not isinstance(min_params, int) or min_params < 1:
        raise ConfigError(f"trainer.strategy.wrap_min_params={min_params!r} must be an integer >= 1; fix: e.g. "
                          f"{DEFAULT_MIN_PARAMS} (a unit gathers at least that many parameters)")
    if isinstance(wrap, str) and wrap.lower() in WRAP_POLICIES:
        return WrapPolicy(wrap.lower(), min_params=min_params)
    names = [wrap] if isinstance(wrap, (str, type)) else list(wrap) if isinstance(wrap, Iterable) else None
    if names and all(isinstance(n, (str, type)) and n for n in names):
        return WrapPolicy("classes", tuple(_class_name(n) for n in names), min_params)
    raise ConfigError(f"trainer.strategy.wrap={wrap!r} is not a wrap policy; fix: use auto, blocks (model.net's "
                      "named blocks), size (submodules of at least wrap_min_params parameters) or a list of "
                      "classes, e.g. [torch.nn.Linear]")


def _class_name(name: str | type) -> str:
    return f"{name.__module__}.{name.__qualname__}" if isinstance(name, type) else str(name)


def _matches(module: nn.Module, names: tuple[str, ...]) -> str | None:
    """The name of ``names`` that ``module``'s class (or a base of it) is: an import path or a bare class name."""
    for cls in type(module).__mro__:
        for name in names:
            if name in (cls.__name__, cls.__qualname__, f"{cls.__module__}.{cls.__qualname__}"):
                return name
            if "." in name and _imported(name) is cls:
                return name  # torch.nn.Linear is torch.nn.modules.linear.Linear
    return None


def _imported(path: str) -> type | None:
    module, _, attr = path.rpartition(".")
    try:
        found = getattr(importlib.import_module(module), attr, None)
    except ImportError:
        return None
    return found if isinstance(found, type) else None


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


@dataclass
class ShardPlan:
    """The units of one module, in the order ``fully_shard`` takes them: ``inner`` (innermost first), then
    ``roots``; each a ``(qualified name, module)`` pair. ``policy`` is what ``auto`` chose."""

    policy: str
    inner: list[tuple[str, nn.Module]]
    roots: list[tuple[str, nn.Module]]

    def describe(self) -> str:
        names = [n for n, _ in self.inner]
        shown = ", ".join(names[:6]) + (f", ... ({len(names)} in all)" if len(names) > 6 else "")
        return (f"wrap={self.policy}: {len(self.inner) + len(self.roots)} units, roots "
                f"{', '.join(n for n, _ in self.roots)}" + (f"; inner {shown}" if names else ""))


def _sequential_net(module: nn.Module) -> nn.Sequential | None:
    net = getattr(module, "net", None)
    return net if isinstance(net, nn.Sequential) and any(_has_params(b) for b in net.children()) else None


def _size_units(root: nn.Module, prefix: str, min_params: int) -> list[tuple[str, nn.Module]]:
    """torch's size-based policy, bottom-up: a submodule whose parameters not yet in a unit below it number at
    least ``min_params`` becomes a unit."""
    units: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()

    def visit(name: str, module: nn.Module) -> int:
        seen.add(id(module))
        rest = sum(p.numel() for p in module.parameters(recurse=False))
        for child_name, child in module.named_children():
            if id(child) not in seen:
                rest += visit(f"{name}.{child_name}", child)
        if module is not root and rest >= min_params:
            units.append((name, module))
            return 0
        return rest

    visit(prefix, root)
    return units


def plan_shards(module: nn.Module, policy: WrapPolicy = AUTO) -> ShardPlan:
    """The units ``policy`` picks in ``module`` (a ConfigError when there is nothing it can shard)."""
    kind = type(module).__name__
    roots = [(n, c) for n, c in module.named_children() if _has_params(c)]
    if not roots:
        raise ConfigError(f"trainer=fsdp found no submodule with parameters to shard in {kind}; fix: hold the "
                          "network's layers in submodules (e.g. self.net), or train with trainer=ddp")
    chosen = policy.kind
    if chosen == "auto":
        chosen = "blocks" if _sequential_net(module) is not None else "size"
    inner: list[tuple[str, nn.Module]] = []
    if chosen == "blocks":
        net = getattr(module, "net", None)
        if not isinstance(net, nn.Sequential):
            got = "none" if net is None else type(net).__name__
            raise ConfigError(f"trainer.strategy.wrap=blocks shards model.net by its named blocks, so it must be an "
                              f"nn.Sequential; {kind}.net is {got}; fix: use trainer.strategy.wrap=auto (or size, or "
                              "a list of classes), or build the net as named blocks (see src/models/components/mlp.py)")
        inner = [(f"net.{n}", b) for n, b in net.named_children() if _has_params(b)]
        if not inner:
            raise ConfigError(f"trainer=fsdp found no block with parameters to shard in model.net ({kind}); fix: "
                              "give the net named blocks holding its layers, or use trainer.strategy.wrap=auto")
    elif chosen == "size":
        for name, root in roots:
            inner += _size_units(root, name, policy.min_params)
    else:
        found: set[str] = set()
        for name, root in roots:
            matched = [(f"{name}.{n}", m, _matches(m, policy.classes)) for n, m in root.named_modules() if n]
            found.update(hit for _, _, hit in matched if hit)
            found.update(hit for hit in [_matches(root, policy.classes)] if hit)
            inner += [(n, m) for n, m, hit in reversed(matched) if hit and _has_params(m)]  # innermost first
        missing = [n for n in policy.classes if n not in found]
        if missing:
            present = sorted({type(m).__name__ for m in module.modules() if m is not module and _has_params(m)})
            raise ConfigError(f"trainer.strategy.wrap names {', '.join(missing)}, which no submodule of {kind} is; "
                              f"fix: name classes it holds ({', '.join(present[:8])}), or use trainer.strategy.wrap=auto")
    plan = ShardPlan(chosen if policy.kind == "auto" else str(policy), inner, roots)
    _check_disjoint(module, plan)
    return plan


def _managed(unit: nn.Module, units: set[int]) -> dict[int, str]:
    """The parameters ``unit`` itself shards (none of a unit nested in it), by id: their names in ``unit``."""
    found: dict[int, str] = {}
    stack, seen = [("", unit)], set()
    while stack:
        prefix, module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        for name, p in module.named_parameters(recurse=False):
            found.setdefault(id(p), prefix + name)
        stack += [(f"{prefix}{n}.", c) for n, c in module.named_children() if id(c) not in units]
    return found


def _check_disjoint(module: nn.Module, plan: ShardPlan) -> None:
    """Each parameter in one unit only (FSDP2 shards a parameter once), and none outside every root."""
    kind = type(module).__name__
    units = [*plan.inner, *plan.roots]
    ids = {id(m) for _, m in units}
    owner: dict[int, str] = {}
    for unit_name, unit in units:
        for pid, name in _managed(unit, ids).items():
            if pid in owner:
                raise ConfigError(f"trainer=fsdp cannot shard {kind}: the parameter {unit_name}.{name} is also "
                                  f"{owner[pid]} (a weight shared by two units); fix: hold both users of it in one "
                                  "submodule (and keep them in one unit: trainer.strategy.wrap), or train with trainer=ddp")
            owner[pid] = f"{unit_name}.{name}"
    outside = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in owner]
    if outside:
        raise ConfigError(f"trainer=fsdp shards {kind}'s submodules, and {kind} holds trainable parameters of its own "
                          f"({outside[:3]}), which no unit would hold; fix: move them into a submodule (e.g. into "
                          "self.net)")


def check_shardable(module: nn.Module, policy: WrapPolicy = AUTO) -> ShardPlan | None:
    """One line for a model FSDP cannot shard (before any rank starts); its plan otherwise (None: sharded already)."""
    if any(isinstance(m, FSDPModule) for m in module.modules()):
        return None  # sharded already (a second fit or test of the same module)
    plan = plan_shards(module, policy)
    if getattr(getattr(module, "hparams", None), "compile", False):
        raise ConfigError("trainer=fsdp shards the net after it is compiled in place, which FSDP2 does not follow; "
                          "fix: set model.compile=false")
    return plan


def mixed_precision(precision: str) -> MixedPrecisionPolicy:
    """trainer.precision as FSDP2's policy: ``bf16-mixed`` gathers and computes in bf16, reduces gradients in
    float32; other precisions keep the parameters' own dtype (``*-true`` converts the model before sharding)."""
    if precision == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard_module(module: nn.Module, mesh: DeviceMesh, reshard_after_forward: bool, mp_policy: MixedPrecisionPolicy,
                 cpu_offload: bool, policy: WrapPolicy = AUTO) -> ShardPlan:
    """``fully_shard`` every unit of ``policy``'s plan, innermost first, then every root; returns the plan."""
    plan = plan_shards(module, policy)
    options = {"mesh": mesh, "mp_policy": mp_policy,
               "offload_policy": CPUOffloadPolicy() if cpu_offload else OffloadPolicy()}
    for _, unit in plan.inner:
        fully_shard(unit, reshard_after_forward=reshard_after_forward, **options)
    for _, root in plan.roots:
        fully_shard(root, **options)  # torch's default for a root: kept whole after forward, backward needs it
    return plan


def shard_by_blocks(module: nn.Module, mesh: DeviceMesh, reshard_after_forward: bool, mp_policy: MixedPrecisionPolicy,
                    cpu_offload: bool) -> ShardPlan:
    """``fully_shard`` every block of ``module.net`` with parameters, then ``net`` (the ``blocks`` policy)."""
    return shard_module(module, mesh, reshard_after_forward, mp_policy, cpu_offload, BLOCKS)


def fsdp_units(module: nn.Module) -> list[nn.Module]:
    """The modules of ``module`` that ``fully_shard`` made into units."""
    return [m for m in module.modules() if isinstance(m, FSDPModule)]
