"""Run-directory checks and the checkpoint a run resumes from (the config checks are in :mod:`src.strategies.preflight`)."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from src.utils.errors import ConfigError

LAST_CHECKPOINT = Path("checkpoints") / "last.ckpt"


def resume_checkpoint(cfg: DictConfig, run_dir: str | Path) -> str | None:
    """The checkpoint ``fit`` starts from: ``ckpt_path``, else (``auto_resume``) the run dir's ``last.ckpt``."""
    if cfg.get("ckpt_path"):
        return str(cfg.ckpt_path)
    last = Path(run_dir) / LAST_CHECKPOINT
    if cfg.get("train") and cfg.get("auto_resume") and last.is_file():
        return str(last)
    return None


def check_no_earlier_checkpoints(cfg: DictConfig, run_dir: str | Path) -> None:
    """Refuse to train into a run directory that holds checkpoints this run would not resume from.

    ModelCheckpoint would otherwise overwrite ``epoch_*.ckpt`` and ``last.ckpt`` of the earlier run.
    Called by a Hydra callback before Hydra writes ``.hydra/``, so a refused run changes nothing.
    """
    ckpt_dir = Path(run_dir) / "checkpoints"
    if not cfg.get("train") or resume_checkpoint(cfg, run_dir) is not None:
        return
    if ckpt_dir.is_dir() and any(ckpt_dir.glob("*.ckpt")):
        raise ConfigError(f"{ckpt_dir} already holds checkpoints of an earlier run; fix: pick a new "
                          f"hydra.run.dir, or resume with ckpt_path={ckpt_dir / 'last.ckpt'} (or auto_resume=true)")
