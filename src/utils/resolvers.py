"""OmegaConf resolvers that make one run directory per run, whoever launched the ranks."""

from __future__ import annotations

import os
from datetime import datetime

from omegaconf import OmegaConf


def run_stamp() -> str:
    """A run-directory name every rank of one launch agrees on.

    Lightning's own launcher passes the parent's directory to its children, but under
    torchrun or srun every rank starts Hydra on its own, and per-second timestamps can
    differ between them. Those launchers export an id shared by all ranks: use it.
    """
    day = datetime.now().strftime("%Y-%m-%d")
    if os.environ.get("SLURM_JOB_ID") and os.environ.get("SLURM_NTASKS", "1") != "1":
        return f"{day}_slurm_{os.environ['SLURM_JOB_ID']}_{os.environ.get('SLURM_STEP_ID', '0')}"
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id:
        return f"{day}_torchrun_{run_id if run_id != 'none' else 'port' + os.environ.get('MASTER_PORT', '')}"
    return datetime.now().strftime("%Y-%m-%d_%H-%M-%S")


def rank_zero_value(value: str) -> str | None:
    """``value`` on global rank 0, None elsewhere (e.g. only rank 0 writes Hydra's ``.hydra/`` subdir)."""
    rank = os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or "0"
    return value if rank == "0" else None


def register_resolvers() -> None:
    for name, fn in (("run_stamp", run_stamp), ("rank_zero", rank_zero_value)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)
