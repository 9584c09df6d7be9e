"""What the ``dp`` and ``pipeline`` strategies need of a LightningModule, as typed protocols checked by hand.

``ddp`` and ``fsdp`` train any LightningModule (``fsdp`` picks its units by a wrap policy,
:mod:`src.engine.strategies.fsdp.wrap`). ``dp`` and ``pipeline`` drive the step themselves, so they need its two
halves (:class:`src.engine.steps.step_module.StepModule` has them):

* ``dp`` (:class:`StepProtocol`): ``model_step(batch) -> dict`` runs on every device's shard of the batch, in
  parallel; ``record_step(stage, out) -> loss`` runs once on the gathered outputs (logging, metrics);
* ``pipeline`` (:class:`PipelineProtocol`): ``net``, an ``nn.Sequential`` of named blocks it splits into
  stages; ``criterion(output, target) -> loss``, run by the last stage per micro-batch; ``record_step``.

:func:`missing_members` names what a module lacks, so each strategy refuses it in one line before any
process starts (``typing.runtime_checkable``'s ``isinstance`` would say only yes or no, and would accept a
``net`` of any type).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from torch import Tensor, nn

__all__ = ["PIPELINE_MEMBERS", "STEP_MEMBERS", "PipelineProtocol", "StepProtocol", "missing_members",
           "protocol_error"]


class StepProtocol(Protocol):
    """What ``trainer=dp`` needs: a step split into its parallel half and its once-per-batch half."""

    def model_step(self, batch: Any) -> Mapping[str, Any]:
        """Forward and loss of one (sub-)batch, no logging: e.g. ``{"loss", "output", "target"}``."""

    def record_step(self, stage: str, out: Mapping[str, Any]) -> Tensor:
        """Metrics and ``self.log`` for the gathered outputs of one global batch; returns the loss."""


class PipelineProtocol(Protocol):
    """What ``trainer=pipeline`` needs: blocks to split, a loss for the last stage, and ``record_step``."""

    net: nn.Sequential

    def criterion(self, output: Tensor, target: Tensor) -> Tensor:
        """The loss of one micro-batch's output, run by the last stage inside the schedule."""

    def record_step(self, stage: str, out: Mapping[str, Any]) -> Tensor:
        """As :meth:`StepProtocol.record_step`, on the last stage's output broadcast over the pipeline."""


# each member, and how a message names it
STEP_MEMBERS = {"model_step": "model_step(batch) -> dict", "record_step": "record_step(stage, out) -> loss"}
PIPELINE_MEMBERS = {"net": "net (an nn.Sequential of named blocks)",
                    "criterion": "criterion(output, target) -> loss",
                    "record_step": "record_step(stage, out) -> loss"}
_DATA_MEMBERS = {"net": nn.Sequential}  # the others are methods


def missing_members(model: Any, members: Mapping[str, str]) -> list[str]:
    """The names of ``members`` that ``model`` lacks (a method not callable, ``net`` not an nn.Sequential)."""
    missing = []
    for name in members:
        value = getattr(model, name, None)
        ok = isinstance(value, _DATA_MEMBERS[name]) if name in _DATA_MEMBERS else callable(value)
        if not ok:
            missing.append(name)
    return missing


def protocol_error(strategy: str, model: Any, members: Mapping[str, str], missing: list[str]) -> str:
    """One line: what ``trainer=<strategy>`` needs, what ``model`` lacks, and the fix."""
    kind = type(model).__name__
    lacks = []
    for name in missing:
        value = getattr(model, name, None)
        lacks.append(name if value is None else f"{name} (it is a {type(value).__name__})")
    if missing == ["net"]:  # a StepModule whose net does not split
        fix = "build the net as an nn.Sequential of named blocks (see src/models/components/mlp.py)"
    else:
        fix = f"subclass src.engine.steps.step_module.StepModule (or define {', '.join(missing)})"
    return (f"trainer={strategy} needs {', '.join(members.values())}; {kind} lacks {', '.join(lacks)}; fix: {fix}, "
            f"or train {kind} with trainer=ddp or trainer=fsdp, which take any LightningModule")
