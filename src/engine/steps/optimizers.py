"""Build the optimizer from its Hydra partial, with torch's fused kernels where the device has them.

``torch.optim.Adam``, ``AdamW`` and ``SGD`` take ``fused=True``: the same update, for all parameters
in one kernel, instead of the default ``foreach`` path's several passes over memory. The maths does
not change (float rounding aside; ``tests/test_optimizers.py`` checks the result equals the unfused
step). A plain script with default flags does not get this; docs/benchmarks.md has what it saves.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable

import torch

from src.engine.utils.pylogger import RankedLogger

log = RankedLogger(__name__)


def takes_fused(factory: Callable[..., torch.optim.Optimizer]) -> bool:
    """Whether ``factory`` (a partial of an optimizer class) accepts ``fused`` and leaves it to us."""
    if not isinstance(factory, functools.partial):
        return False
    chosen = factory.keywords.keys() & {"fused", "foreach", "differentiable"}
    try:
        accepts = "fused" in inspect.signature(factory.func).parameters
    except (TypeError, ValueError):
        return False
    return accepts and not chosen


def build_optimizer(factory: Callable[..., torch.optim.Optimizer], params: Iterable[torch.nn.Parameter],
                    fused: bool = True) -> torch.optim.Optimizer:
    """``factory(params=...)``, with ``fused=True`` when asked, accepted and supported for these parameters.

    A config that sets ``fused``, ``foreach`` or ``differentiable`` itself is left as it is. Where torch
    has no fused kernel for the parameters' device or dtype, its constructor raises, and the default
    (unfused) optimizer is built instead.
    """
    params = list(params)
    if fused and takes_fused(factory) and not fused_on_shards(factory, params):
        log.info(f"{factory.func.__name__}: torch has no fused step for sharded (DTensor) parameters; using the "
                 "default implementation")
        fused = False
    if fused and takes_fused(factory):
        try:
            return factory(params=params, fused=True)
        except (RuntimeError, ValueError) as err:  # no fused kernel for this device/dtype
            log.info(f"{factory.func.__name__}: no fused kernel here ({err}); using the default implementation")
    return factory(params=params)


# The fused steps torch gives DTensor rules for (its DTensor pointwise ops list them; SGD's is missing in 2.14)
FUSED_ON_DTENSOR = (torch.optim.Adam, torch.optim.AdamW)


def fused_on_shards(factory: functools.partial, params: list[torch.nn.Parameter]) -> bool:
    """False when ``params`` are FSDP2 shards (DTensors) and the fused step of ``factory``'s class has no DTensor rule."""
    from torch.distributed.tensor import DTensor

    if not any(isinstance(p, DTensor) for p in params):
        return True
    return isinstance(factory.func, type) and issubclass(factory.func, FUSED_ON_DTENSOR)


def is_fused(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` steps with torch's fused kernel."""
    return any(group.get("fused") for group in optimizer.param_groups)
