"""Bench-only callbacks that put back what the project turns off, for ``--variant`` runs.

Added on the command line, not in any config, e.g.
``--variant "nvmlon=+callbacks.nvmlon._target_=scripts.bench.switches.NvmlSwitchOn"``.
"""

from __future__ import annotations

import os

from lightning import Callback, LightningModule, Trainer


class NvmlSwitchOn(Callback):
    """Sets ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` again when training starts, as ``import lightning`` leaves it:
    the project as it was before it dropped the switch where NVML cannot load."""

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
