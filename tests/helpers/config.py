"""Compose the project's Hydra configs for tests: CPU, tiny runs, output into a temp dir."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

from src.engine.run.identity import ensure_run_uid
from src.engine.utils.resolvers import register_resolvers

ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = ROOT / "configs"

# Small, CPU-only defaults so a fit + test takes a few seconds. The accelerator is forced after the trainer
# group, so `trainer=ddp`/`dp`/`pipeline` (accelerator: auto) stay on the CPU too; a GPU test adds
# `trainer.accelerator=gpu` to its overrides, which come later and win.
TINY = [
    "trainer=cpu",
    "trainer.accelerator=cpu",
    "trainer.max_epochs=1",
    "++trainer.limit_train_batches=8",
    "++trainer.limit_val_batches=4",
    "++trainer.limit_test_batches=4",
    "extras.print_config=false",
    "logger=csv",
]


def compose_cfg(config_name: str, overrides: Sequence[str], output_dir: Path, tiny: bool = True) -> DictConfig:
    """Compose ``configs/<config_name>.yaml`` with ``overrides`` as the entry point would, without running Hydra's job."""
    register_resolvers()
    output_dir.mkdir(parents=True, exist_ok=True)
    ensure_run_uid(output_dir)  # what the run room's Hydra callback does when a job starts
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(CONFIG_DIR)):
        cfg = compose(config_name, overrides=[*(TINY if tiny else []), *overrides], return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(output_dir)
        cfg.hydra.job.num = 0
        cfg.hydra.job.id = "test"
        cfg.paths.root_dir = str(ROOT)
        cfg.paths.data_dir = str(ROOT / "data")
        cfg.paths.log_dir = str(output_dir)
    HydraConfig().set_config(cfg)
    with open_dict(cfg):
        cfg.paths.output_dir = str(output_dir)
        cfg.paths.work_dir = str(ROOT)
    return cfg
