"""OmegaConf resolvers. They only read: the run's id, rank-0-only values, a negation."""

from __future__ import annotations

from omegaconf import OmegaConf

from src.engine.run.identity import read_run_uid
from src.engine.runtime.launch_context import launch_context


def rank_zero_value(value: str) -> str | None:
    """``value`` on global rank 0, None elsewhere (e.g. only rank 0 writes Hydra's ``.hydra/`` subdir)."""
    return value if launch_context().is_global_zero else None


def negation(value: object) -> bool:
    """``${not:...}``: e.g. cuDNN's autotuner only when the run is not deterministic."""
    return not value


def register_resolvers() -> None:
    for name, fn in (("run_uid", read_run_uid), ("rank_zero", rank_zero_value),
                     ("not", negation)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)
