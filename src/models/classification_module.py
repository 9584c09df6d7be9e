"""Image classification: cross-entropy loss, exact distributed loss/accuracy via torchmetrics."""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import MaxMetric

from src.engine import STAGES, SampleAccuracy, SampleMean, StepModule, StepOutput


class ClassificationModule(StepModule):
    """Logs ``{train,val,test}/loss``, ``{train,val,test}/acc`` and ``val/acc_best``.

    Loss and accuracy are torchmetrics objects (:mod:`src.engine.steps.metrics`): each rank accumulates sums
    and counts, and they are all-reduced once at epoch end, so the logged value is the exact mean over
    all samples seen by all ranks (not a mean of per-rank means).
    """

    task = "classification"  # pairs with data of the same task (src/engine/utils/config_checks.py)
    best_of = "acc"  # val/acc_best
    capture_safe = True  # criterion may run inside a captured step (src/engine/steps/step_capture.py)

    def __init__(self, net: nn.Module, optimizer: Any, scheduler: Any | None = None, **options: Any) -> None:
        """``options``: the :class:`~src.engine.steps.step_module.StepModule` switches (compile, fused_optimizer...)."""
        super().__init__(net=net, optimizer=optimizer, scheduler=scheduler, **options)
        for stage in STAGES:  # train_loss, val_loss, test_loss, train_acc, ...
            setattr(self, f"{stage}_loss", SampleMean())
            setattr(self, f"{stage}_acc", SampleAccuracy())
        self.val_acc_best = MaxMetric()

    def criterion(self, output: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(output, target)

    def prediction(self, output: Tensor) -> Tensor:
        """Each class's probability (softmax over the logits, in float32)."""
        return F.softmax(output.float(), dim=1)

    def record_step(self, stage: str, out: StepOutput) -> Tensor:
        loss, target = out["loss"], out["target"]
        loss_metric, acc_metric = getattr(self, f"{stage}_loss"), getattr(self, f"{stage}_acc")
        loss_metric.update(loss, target.shape[0])
        acc_metric.update(out["output"], target)
        self.log_epoch_metric(f"{stage}/loss", loss_metric)
        self.log_epoch_metric(f"{stage}/acc", acc_metric)
        return loss
