"""The template's code. The machinery moved under ``src/engine/`` (2026-12-02, see docs/migration.md).

For one release the old import paths (``src.strategies.ddp``, ``src.models.step_module``, ...) still
work, with a ``DeprecationWarning``: configs and code written earlier keep running, and checkpoints that
name an old path load. The old name is an alias: it is the very module at the new path, so classes are
not defined twice.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

_MOVED_PACKAGES = {f"src.{name}": f"src.engine.{name}" for name in (
    "callbacks", "checkpointing", "collectives", "loggers", "run", "runtime", "search", "strategies", "utils")}
_MOVED_MODULES = {
    **{f"src.models.{name}": f"src.engine.steps.{name}" for name in (
        "metrics", "optimizers", "owned_step", "step_capture", "step_module", "step_output")},
    **{f"src.data.{name}": f"src.engine.data.{name}" for name in (
        "in_memory_datamodule", "predict_datamodule", "predict_inputs")},
    "src.data.components.safe_unpickle": "src.engine.utils.safe_unpickle",
    **{f"src.data.components.{name}": f"src.engine.data.{name}" for name in (
        "batch_transforms", "folds", "in_memory", "resumable_loader")},
}


def moved_to(old: str) -> str | None:
    """The new import path of the module that was ``old``, or None where ``old`` did not move."""
    if old in _MOVED_MODULES:
        return _MOVED_MODULES[old]
    package = ".".join(old.split(".")[:2])
    return _MOVED_PACKAGES[package] + old[len(package):] if package in _MOVED_PACKAGES else None


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers an old import path with the module at its new one (first on ``sys.meta_path``, so that no
    path finder loads a second copy of a moved module under its old name)."""

    def find_spec(self, fullname, path=None, target=None):
        return importlib.util.spec_from_loader(fullname, self) if moved_to(fullname) else None

    def create_module(self, spec):
        new = moved_to(spec.name)
        warnings.warn(f"{spec.name} moved to {new}: import it from there, or through src.engine "
                      "(the old path goes in the next release)", DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module) -> None:
        pass  # the module at the new path has run already


if not any(isinstance(finder, _OldPaths) for finder in sys.meta_path):
    sys.meta_path.insert(0, _OldPaths())
