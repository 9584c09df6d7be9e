"""Config checks, errors, Hydra glue, logging and the guarded private names the machinery shares.

ashleve's template exports its helpers from ``src.utils``; here ``src.engine`` exports them, and for one release
``from src.utils import extras, task_wrapper`` (this package, under its old name) still finds them there.
"""

from __future__ import annotations

from typing import Any

_ASHLEVES_NAMES = ("RankedLogger", "extras", "get_metric_value", "instantiate_callbacks", "instantiate_loggers",
                   "log_hyperparameters", "print_config_tree", "task_wrapper")
__all__ = list(_ASHLEVES_NAMES)


def __getattr__(name: str) -> Any:
    if name not in _ASHLEVES_NAMES:
        raise AttributeError(f"module 'src.engine.utils' has no attribute {name!r}")
    import src.engine

    return getattr(src.engine, name)
