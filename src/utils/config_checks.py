"""Cross-group consistency checks that Hydra cannot express."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from src.utils.errors import ConfigError


def check_model_data_pair(cfg: DictConfig) -> None:
    """The toy regression model needs the toy data, and classifiers need labelled images."""
    regression_model = str(cfg.model.get("_target_", "")).endswith("RegressionModule")
    regression_data = "num_classes" not in cfg.data
    if regression_model and not regression_data:
        raise ConfigError("model=toy is a regression model for synthetic vectors: use data=toy (or experiment=toy)")
    if regression_data and not regression_model:
        raise ConfigError("data=toy is regression data: use model=toy (or experiment=toy)")


def check_batch_size(datamodule, trainer) -> None:
    """The global batch must split evenly over the data-parallel replicas the strategy will create.

    ``distributed_sampler_kwargs`` is known as soon as the Trainer exists, before the
    launcher starts any process, so a bad batch size fails once, in the parent.
    """
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
    if hasattr(datamodule, "per_replica_batch_size"):
        datamodule.per_replica_batch_size(int(kwargs.get("num_replicas", 1)))


def check_no_earlier_checkpoints(cfg: DictConfig) -> None:
    """Refuse to train into a run directory that already holds checkpoints, unless resuming.

    ModelCheckpoint would otherwise overwrite ``epoch_*.ckpt`` and ``last.ckpt`` of the earlier run.
    """
    ckpt_dir = Path(cfg.paths.output_dir) / "checkpoints"
    if cfg.get("train") and not cfg.get("ckpt_path") and ckpt_dir.is_dir() and any(ckpt_dir.glob("*.ckpt")):
        raise ConfigError(f"{ckpt_dir} already holds checkpoints of an earlier run: pick a new hydra.run.dir, "
                          f"or resume with ckpt_path={ckpt_dir / 'last.ckpt'}")
