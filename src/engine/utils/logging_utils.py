"""Send the composed run config and the parameter counts to every logger, from rank 0, once per run."""

from __future__ import annotations

from typing import Any

from lightning import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import OmegaConf

from src.engine.utils.pylogger import RankedLogger

log = RankedLogger(__name__)

# Config sections a user compares runs by (the optimizer and scheduler live under `model`).
SECTIONS = ("model", "data", "trainer", "callbacks")
VALUES = ("task_name", "tags", "seed", "ckpt_path")


@rank_zero_only
def log_hyperparameters(object_dict: dict[str, Any]) -> None:
    """Log the resolved config sections, seed and parameter counts to each of the trainer's loggers.

    As ashleve's ``log_hyperparameters``. The module saves its own hparams with ``logger=False``, so
    without this TensorBoard's ``hparams.yaml`` is ``{}`` and MLflow's ``params/`` is empty. The
    values are sent when the trainer sets up (see :class:`HyperparameterLogger`), not here.
    """
    cfg, model, trainer = object_dict["cfg"], object_dict["model"], object_dict["trainer"]
    if not trainer.loggers:
        return
    hparams: dict[str, Any] = {
        name: OmegaConf.to_container(cfg[name], resolve=True) for name in SECTIONS if cfg.get(name) is not None
    }
    params = list(model.parameters())
    hparams["model/params/total"] = sum(p.numel() for p in params)
    hparams["model/params/trainable"] = sum(p.numel() for p in params if p.requires_grad)
    hparams["model/params/non_trainable"] = hparams["model/params/total"] - hparams["model/params/trainable"]
    for name in VALUES:
        value = cfg.get(name)
        hparams[name] = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
    trainer.callbacks.append(HyperparameterLogger(hparams))


class HyperparameterLogger(Callback):
    """Logs ``hparams`` once, from global rank 0 of the process that runs the loop.

    Logging at setup rather than in the launching process matters for ``ddp_spawn``: there the
    parent's loggers are copied into each launch, and a CSV experiment opened in the parent would be
    shared by the fit and test launches, whose writers then disagree on the file's columns.
    """

    def __init__(self, hparams: dict[str, Any]) -> None:
        self.hparams = hparams
        self._logged = False

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._logged or not trainer.is_global_zero:
            return
        for logger in trainer.loggers:
            logger.log_hyperparams(self.hparams)
        self._logged = True
        log.info(f"Logged the config and parameter counts to {', '.join(type(lg).__name__ for lg in trainer.loggers)}")
