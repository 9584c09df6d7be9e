"""One line for a strategy option the chosen strategy does not take, naming the strategy that does.

Left alone, ``trainer=ps +trainer.strategy.stages=2`` or ``trainer=ddp +trainer.strategy.bogus=1`` reaches
Lightning's DDP constructor, which hands unknown keywords to torch's ``DistributedDataParallel``: a
traceback once the ranks have started. Each strategy's options are its constructors' parameters (and, for
Lightning's DDP, ``DistributedDataParallel``'s); this module only compares them, so no strategy lists
another's.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from functools import cache
from typing import Any

from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy
from lightning.pytorch.strategies import Strategy
from torch.nn.parallel import DistributedDataParallel

from src.engine.utils.errors import ConfigError

_NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def _parameters(init: Any) -> set[str]:
    return {n for n, p in inspect.signature(init).parameters.items() if p.kind in _NAMED and n != "self"}


@cache
def accepted_options(strategy: type) -> frozenset[str]:
    """Every keyword ``strategy``'s constructor takes: its own, and those it hands on to its bases (all of
    them, unless it says ``names_every_option``)."""
    if getattr(strategy, "names_every_option", False):
        return frozenset(_parameters(strategy.__init__))
    names = set().union(*(_parameters(c.__init__) for c in strategy.__mro__ if "__init__" in vars(c)))
    if issubclass(strategy, LightningDDPStrategy):  # Lightning passes its other keywords on to torch's DDP
        names |= _parameters(DistributedDataParallel.__init__) - {"module"}
    return frozenset(names)


def _project_strategies(base: type = Strategy) -> Iterable[type]:
    """The project's strategies that a ``trainer=<strategy_name>`` config builds: the subclasses of Lightning's
    ``Strategy`` in ``src`` that name themselves (loaded by now: every strategy module is in ``src.engine.strategies``,
    whose ``__init__`` imports them all)."""
    for sub in base.__subclasses__():
        if sub.__module__.startswith("src.") and vars(sub).get("strategy_name"):
            yield sub
        yield from _project_strategies(sub)


def refuse_foreign_options(strategy: type, options: Mapping[str, Any]) -> None:
    """Raise one line for the first key of ``options`` that ``strategy`` (one with a ``strategy_name``) does
    not take."""
    unknown = [key for key in options if key not in accepted_options(strategy)]
    if not unknown:
        return
    key, name = unknown[0], strategy.strategy_name
    owner = next((s.strategy_name for s in _project_strategies()
                  if s.strategy_name != name and key in accepted_options(s)), None)
    if owner is not None:
        raise ConfigError(f"trainer.strategy.{key} is a trainer={owner} setting, but this run uses trainer={name}; "
                          f"fix: remove trainer.strategy.{key}, or use trainer={owner}")
    raise ConfigError(f"trainer.strategy.{key} is not an option of trainer={name}; fix: remove it (check its spelling "
                      f"in configs/trainer/{name}.yaml and docs/strategies.md)")
