"""Build lists of callbacks and loggers from their config groups with Hydra's ``instantiate``."""

from __future__ import annotations

import hydra
from lightning import Callback
from lightning.pytorch.callbacks import DeviceStatsMonitor, LearningRateMonitor
from lightning.pytorch.loggers import Logger
from omegaconf import DictConfig

from src.engine.utils.errors import ConfigError
from src.engine.utils.pylogger import RankedLogger

log = RankedLogger(__name__)


def instantiate_group(cfg: DictConfig | None, kind: type, group: str) -> list:
    """Instantiate every ``_target_`` node under ``cfg``; each must build an instance of ``kind``."""
    objects: list = []
    if not cfg:
        return objects
    if not isinstance(cfg, DictConfig):
        raise ConfigError(f"the {group} config is not a mapping of name -> object config; fix: give each entry a name")
    for name, node in cfg.items():
        if isinstance(node, DictConfig) and "_target_" in node:
            obj = hydra.utils.instantiate(node)
            if not isinstance(obj, kind):
                raise ConfigError(f"{group}.{name} built a {type(obj).__name__}, not a {kind.__name__}; fix: point its _target_ at a "
                                 f"{kind.__name__}")
            objects.append(obj)
    return objects


def instantiate_callbacks(cfg: DictConfig | None) -> list[Callback]:
    return instantiate_group(cfg, Callback, "callbacks")


def instantiate_loggers(cfg: DictConfig | None) -> list[Logger]:
    return instantiate_group(cfg, Logger, "logger")


def drop_callbacks_needing_a_logger(callbacks: list[Callback], loggers: list[Logger]) -> list[Callback]:
    """Leave out the monitors that refuse to start without a logger (``logger=none``), saying so."""
    if loggers:
        return callbacks
    needing = (LearningRateMonitor, DeviceStatsMonitor)
    for cb in callbacks:
        if isinstance(cb, needing):
            log.info(f"No logger (logger=none): {type(cb).__name__} is left out; it needs a logger")
    return [cb for cb in callbacks if not isinstance(cb, needing)]
