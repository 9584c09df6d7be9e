"""The helper names ashleve's template exports from ``src.utils``, loaded on first use.

``from src.utils import extras, task_wrapper`` works as it does there. The names are resolved lazily
(PEP 562), so importing a light module such as ``src.utils.errors`` does not import Lightning.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "RankedLogger": "src.utils.pylogger",
    "extras": "src.utils.task",
    "get_metric_value": "src.utils.task",
    "task_wrapper": "src.utils.task",
    "instantiate_callbacks": "src.utils.instantiators",
    "instantiate_loggers": "src.utils.instantiators",
    "log_hyperparameters": "src.utils.logging_utils",
    "print_config_tree": "src.utils.rich_utils",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'src.utils' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
