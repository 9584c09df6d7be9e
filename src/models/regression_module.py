"""Regression with mean-squared error, for the toy model on synthetic data."""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import MinMetric

from src.engine import STAGES, SampleMean, StepModule, StepOutput


class RegressionModule(StepModule):
    """Logs ``{train,val,test}/loss`` (exact sample-weighted MSE across ranks) and ``val/loss_best``."""

    task = "regression"  # pairs with data of the same task (src/engine/utils/config_checks.py)
    best_of = "loss"  # val/loss_best
    capture_safe = True  # criterion may run inside a captured step (src/engine/steps/step_capture.py)

    def __init__(self, net: nn.Module, optimizer: Any, scheduler: Any | None = None, **options: Any) -> None:
        """``options``: the :class:`~src.engine.steps.step_module.StepModule` switches (compile, fused_optimizer...)."""
        super().__init__(net=net, optimizer=optimizer, scheduler=scheduler, **options)
        for stage in STAGES:  # train_loss, val_loss, test_loss
            setattr(self, f"{stage}_loss", SampleMean())
        self.val_loss_best = MinMetric()

    def criterion(self, output: Tensor, target: Tensor) -> Tensor:
        return F.mse_loss(output, target)

    def record_step(self, stage: str, out: StepOutput) -> Tensor:
        loss = out["loss"]
        loss_metric = getattr(self, f"{stage}_loss")
        loss_metric.update(loss, out["target"].shape[0])
        self.log_epoch_metric(f"{stage}/loss", loss_metric)
        return loss
