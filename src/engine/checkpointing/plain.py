"""A checkpoint's hyper-parameters as plain values, so this project's files load with ``weights_only=True``.

``save_hyperparameters()`` stores whatever ``__init__`` received. A module in the style of ashleve's template
receives its ``net`` (an ``nn.Module``) and its optimizer and scheduler as ``functools.partial`` objects from
Hydra, and a data module receives lists as OmegaConf ``ListConfig``. Pickled as they are, those make the file
unloadable without ``weights_only=False``, which would let any crafted file run code.

Nothing here needs them back: every entry point builds the module from the run's config, and a resume
restores weights, optimizer, loops and callbacks, never the hyper-parameters. So before a save, OmegaConf
containers become plain lists and dicts, and any other object becomes a string that names it
(``<not saved: ...>``). ``Module.load_from_checkpoint(path, net=...)`` still works outside the project:
Lightning's documented way for arguments that are objects.
"""

from __future__ import annotations

import enum
import pathlib
from collections.abc import Mapping
from typing import Any

import torch

HYPER_PARAMETER_KEYS = ("hyper_parameters", "datamodule_hyper_parameters")
NOT_SAVED = "<not saved: "
_PLAIN = (str, int, float, bool, complex, bytes, type(None), torch.Tensor, torch.dtype, torch.device, torch.Size)


def plain_hyperparameters(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """``checkpoint`` with its hyper-parameter entries made plain (a shallow copy when anything changed)."""
    found = {key: checkpoint[key] for key in HYPER_PARAMETER_KEYS if key in checkpoint}
    if not found:
        return checkpoint
    return {**checkpoint, **{key: plain(value) for key, value in found.items()}}


def plain(value: Any) -> Any:
    """``value`` as tensors, numbers, strings, lists and dicts; any other object as a string naming it."""
    if isinstance(value, _PLAIN):
        return value
    if _is_omegaconf(value):
        from omegaconf import OmegaConf

        try:
            return plain(OmegaConf.to_container(value, resolve=True))
        except Exception:  # an interpolation that only resolves inside the full config
            return plain(OmegaConf.to_container(value, resolve=False))
    if isinstance(value, Mapping):
        return {plain_key(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((plain(v) for v in value), key=repr)
    if isinstance(value, enum.Enum):
        return plain(value.value)
    if isinstance(value, pathlib.PurePath):
        return str(value)
    return f"{NOT_SAVED}{described(value)}>"


def plain_key(key: Any) -> Any:
    return key if isinstance(key, (str, int, float, bool, type(None))) else str(key)


def described(value: Any) -> str:
    """A short name for an object: its class, and for a partial the callable and its arguments."""
    import functools

    if isinstance(value, functools.partial):
        func = getattr(value.func, "__qualname__", repr(value.func))
        module = getattr(value.func, "__module__", "")
        args = [repr(a) for a in value.args] + [f"{k}={v!r}" for k, v in value.keywords.items()]
        return f"functools.partial({module}.{func}, {', '.join(args)})"[:300]
    cls = type(value)
    if isinstance(value, torch.nn.Module):
        return f"an nn.Module of class {cls.__module__}.{cls.__qualname__}; its weights are in state_dict"
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    return f"a {cls.__module__}.{cls.__qualname__}"


def _is_omegaconf(value: Any) -> bool:
    return type(value).__module__.startswith("omegaconf.")


def stored_targets(checkpoint: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Every ``(where, _target_)`` inside the checkpoint's hyper-parameters (a stored Hydra config)."""
    found: list[tuple[str, str]] = []

    def walk(node: Any, where: str) -> None:
        if isinstance(node, Mapping):
            target = node.get("_target_")
            if isinstance(target, str):
                found.append((where, target))
            for k, v in node.items():
                walk(v, f"{where}.{k}")
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                walk(v, f"{where}[{i}]")

    for key in HYPER_PARAMETER_KEYS:
        walk(checkpoint.get(key), key)
    return found
