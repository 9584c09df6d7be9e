"""The helper names ashleve's template exports from ``src.engine.utils``, loaded on first use.

``from src.engine.utils import extras, task_wrapper`` works as it does there. The names are resolved lazily
(PEP 562), so importing a light module such as ``src.engine.utils.errors`` does not import Lightning.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "RankedLogger": "src.engine.utils.pylogger",
    "extras": "src.engine.utils.task",
    "get_metric_value": "src.engine.utils.task",
    "task_wrapper": "src.engine.utils.task",
    "instantiate_callbacks": "src.engine.utils.instantiators",
    "instantiate_loggers": "src.engine.utils.instantiators",
    "log_hyperparameters": "src.engine.utils.logging_utils",
    "print_config_tree": "src.engine.utils.rich_utils",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'src.engine.utils' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
