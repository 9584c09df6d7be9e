"""``SingleDeviceStrategy``: Lightning's single-device strategy with the project's checkpoint files.

One-process runs (``trainer=default``, ``cpu``, ``gpu``, ``mps``) write checkpoints atomically and load
them with ``weights_only=True`` (:mod:`src.engine.checkpointing.io`), as the multi-process strategies do;
the default lives in the strategy class, so ``Trainer(strategy=SingleDeviceStrategy())`` gets it too.
Given no device, the strategy takes the one the Trainer picks from ``accelerator`` and ``devices``.
One-process stop signals come from the :class:`src.engine.checkpointing.stop_signals.StopSignals` callback (in the
default callbacks): a strategy has no hook at the end of a training batch, the one point where a stop is
saved whole.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.strategies import SingleDeviceStrategy as LightningSingleDeviceStrategy

from src.engine.checkpointing.io import AtomicCheckpointIODefault
from src.engine.runtime.loader_workers import WorkersOutliveStopSignals
from src.engine.strategies.options import refuse_foreign_options
from src.engine.utils.errors import ConfigError


class SingleDeviceStrategy(WorkersOutliveStopSignals, AtomicCheckpointIODefault, LightningSingleDeviceStrategy):
    """Lightning's :class:`~lightning.pytorch.strategies.SingleDeviceStrategy`, atomic checkpoints by default.

    Args:
        device: the device to train on; ``None`` takes the Trainer's choice (``trainer.accelerator`` and
            ``trainer.devices``, which must name one device).
        **kwargs: Lightning's SingleDeviceStrategy arguments.
    """

    strategy_name = "default"  # configs/trainer/default.yaml (cpu, gpu and mps build it too)
    runs_owned_step = True  # the module may own its training step (src/engine/steps/owned_step.py)

    def __init__(self, device: str | torch.device | int | None = None, **kwargs: Any) -> None:
        refuse_foreign_options(type(self), kwargs)
        super().__init__(device="cpu" if device is None else device, **kwargs)
        self._chosen_by_trainer = device is None

    _device_from_trainer: torch.device | None = None  # the Trainer's device, once it gave one

    @property
    def root_device(self) -> torch.device:
        """The device given, or the Trainer's (Lightning sets its own only in ``__init__``)."""
        return super().root_device if self._device_from_trainer is None else self._device_from_trainer

    @property
    def parallel_devices(self) -> list[torch.device] | None:
        """The Trainer fills this in when no device was given (its accelerator connector looks for it)."""
        return None if self._chosen_by_trainer else [self.root_device]

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device]) -> None:
        if len(devices) != 1:
            raise ConfigError(f"trainer.devices={len(devices)} but this trainer config runs one device; fix: use "
                              f"trainer=ddp (or dp, pipeline) for several devices, or set trainer.devices=1")
        self._device_from_trainer = devices[0]
        self._chosen_by_trainer = False
