"""Run one global batch through the pipeline and hand every rank the same step outputs.

Every rank of a pipeline receives the same batch. The first stage feeds the inputs, the
last stage holds the output (and, in training, the per-micro-batch losses), then the last
stage broadcasts ``[loss, output]`` over the pipeline group so that ``record_step`` sees
identical values on every rank.

Schedules are cached per ``(training, micro-batch shape, dtype)``: a ``PipelineStage``
fixes its receive buffers' shapes at its first step, so a batch of another size needs its
own stage objects (cheap: they wrap the same blocks). Evaluation uses forward-only schedules
(built without a loss) rather than ``schedule.eval()`` on the training schedule, since flipping
one schedule between modes makes torch redo its stage warm-up at every train/eval switch.

**Evaluation batches that do not divide** (the eval loaders keep their last, smaller
batch): the batch is *padded* with copies of its first row up to a multiple of
``n_microbatches``, run forward, and the padded rows are *cut off* the output before the
loss is computed on the last stage. Eval-mode forwards treat samples independently, so the
metrics over the real rows are exact. Training batches must divide (the train loader drops
its last partial batch).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from src.engine.steps.step_module import StepOutput
from src.engine.strategies.pipeline.mesh import PipelineMesh
from src.engine.strategies.pipeline.schedule import build_schedule


class PipelineRunner:
    """Owns this rank's stage modules and the schedules built over them."""

    def __init__(
        self,
        modules: Sequence[tuple[int, nn.Module]],
        num_stages: int,
        mesh: PipelineMesh,
        device: torch.device,
        schedule: str,
        n_microbatches: int,
        criterion: Callable[[Tensor, Tensor], Tensor],
    ) -> None:
        self.modules = list(modules)
        self.num_stages = num_stages
        self.mesh = mesh
        self.device = device
        self.schedule_name = schedule
        self.n_microbatches = n_microbatches
        self.criterion = criterion
        self._schedules: dict[tuple, object] = {}
        self._out_shape: tuple[int, ...] | None = None  # per-sample output shape, learnt at the first step

    @property
    def holds_first(self) -> bool:
        return any(index == 0 for index, _ in self.modules)

    @property
    def holds_last(self) -> bool:
        return any(index == self.num_stages - 1 for index, _ in self.modules)

    def _schedule(self, training: bool, inputs: Tensor):
        micro_shape = (inputs.shape[0] // self.n_microbatches, *inputs.shape[1:])
        key = (training, micro_shape, inputs.dtype)
        if key not in self._schedules:
            loss_fn = self.criterion if training else None
            self._schedules[key] = build_schedule(
                self.schedule_name, self.modules, self.num_stages, self.device, self.mesh.pp_group,
                self.n_microbatches, loss_fn,
            )
        return self._schedules[key]

    def train_step(self, inputs: Tensor, target: Tensor) -> StepOutput:
        """Forward and backward of every micro-batch; gradients land in this rank's parameters.

        The gradients are those of the full-batch mean loss (scaled by ``1/n_microbatches``
        inside the schedule). Returns the full-batch output and mean loss on every rank.
        """
        schedule = self._schedule(True, inputs)  # the batch divides: src.engine.strategies.global_batch checked it
        losses: list[Tensor] = []
        args = (inputs,) if self.holds_first else ()
        output = schedule.step(*args, target=target, losses=losses)
        loss = torch.stack([x.detach() for x in losses]).mean() if self.holds_last else None
        output = output.detach() if output is not None else None
        return self._share(output, loss, target)

    def eval_step(self, inputs: Tensor, target: Tensor) -> StepOutput:
        """Forward only, padding a batch that does not divide into ``n_microbatches`` (see module doc)."""
        size = target.shape[0]
        padded = math.ceil(size / self.n_microbatches) * self.n_microbatches
        if padded != size:
            filler = inputs[:1].expand(padded - size, *inputs.shape[1:])
            inputs = torch.cat([inputs, filler])
        schedule = self._schedule(False, inputs)
        args = (inputs,) if self.holds_first else ()
        output = schedule.step(*args)
        loss = None
        if self.holds_last:
            output = output[:size]
            loss = self.criterion(output, target)
        return self._share(output, loss, target)

    def _share(self, output: Tensor | None, loss: Tensor | None, target: Tensor) -> StepOutput:
        """Broadcast the last stage's ``loss`` and ``output`` (as float32) to every rank of the pipeline."""
        if self.mesh.layout.pp == 1:
            return StepOutput(loss=loss.float(), output=output.float(), target=target)
        src = self.mesh.layout.global_rank(self.mesh.dp_rank, self.mesh.layout.pp - 1)
        if self._out_shape is None:
            shape = [tuple(output.shape[1:]) if output is not None else None]
            dist.broadcast_object_list(shape, src=src, group=self.mesh.pp_group, device=self.device)
            self._out_shape = shape[0]
        size = target.shape[0]
        packed = torch.empty(1 + size * math.prod(self._out_shape), dtype=torch.float32, device=self.device)
        if self.holds_last:
            packed[0] = loss
            packed[1:] = output.reshape(-1)
        dist.broadcast(packed, src=src, group=self.mesh.pp_group)
        return StepOutput(loss=packed[0], output=packed[1:].view(size, *self._out_shape), target=target)
