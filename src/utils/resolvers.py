"""OmegaConf resolvers: the run directory every rank of a launch agrees on, its id, and rank-0-only values."""

from __future__ import annotations

from omegaconf import OmegaConf

from src.runtime.launch_context import launch_context
from src.utils.run_identity import run_dir_name, run_uid


def rank_zero_value(value: str) -> str | None:
    """``value`` on global rank 0, None elsewhere (e.g. only rank 0 writes Hydra's ``.hydra/`` subdir)."""
    return value if launch_context().is_global_zero else None


def negation(value: object) -> bool:
    """``${not:...}``: e.g. cuDNN's autotuner only when the run is not deterministic."""
    return not value


def register_resolvers() -> None:
    for name, fn in (("run_dir", run_dir_name), ("run_uid", run_uid), ("rank_zero", rank_zero_value),
                     ("not", negation)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)
