"""Run-directory checks of ``src/train.py`` (the config checks are in :mod:`src.strategies.preflight`)."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from src.utils.errors import ConfigError


def check_no_earlier_checkpoints(cfg: DictConfig) -> None:
    """Refuse to train into a run directory that already holds checkpoints, unless resuming.

    ModelCheckpoint would otherwise overwrite ``epoch_*.ckpt`` and ``last.ckpt`` of the earlier run.
    """
    ckpt_dir = Path(cfg.paths.output_dir) / "checkpoints"
    if cfg.get("train") and not cfg.get("ckpt_path") and ckpt_dir.is_dir() and any(ckpt_dir.glob("*.ckpt")):
        raise ConfigError(f"{ckpt_dir} already holds checkpoints of an earlier run: pick a new hydra.run.dir, "
                          f"or resume with ckpt_path={ckpt_dir / 'last.ckpt'}")
