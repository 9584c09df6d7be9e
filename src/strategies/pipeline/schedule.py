"""Pipeline schedules by name, their constraints, and building ``PipelineStage`` objects plus a schedule.

All of it is ``torch.distributed.pipelining``: names resolve through torch's own registry
(``get_schedule_class``), multi-stage schedules are recognised by their base class
(``PipelineScheduleMulti``), and virtual stages are placed the way the interleaved schedule expects
("loop" placement: stage ``i`` lives on pipeline rank ``i % pp``). This module checks the
constraints torch would otherwise report late, after the processes are up.

**Receives posted up front** (GPipe and 1F1B): torch's single-stage schedules post each receive
only when the stage is about to use it. Gloo's point-to-point is a rendezvous (a send completes
once the peer has posted the matching receive), so every micro-batch then pays a transfer on
the critical path: the receiver idles while the payload moves, and 1F1B's fused send+receive
batches stall the sender too. :class:`PrefetchGPipe` and :class:`Prefetch1F1B` run the same
per-rank order of forwards and backwards (same arithmetic, same gradients), but post all of a
step's receives into their per-micro-batch buffers at the start and wait for sends only at the
end, so activations and gradients move while the stages compute. Gloo only: NCCL runs a
communicator's point-to-point operations in one stream, in posting order, where receives posted
ahead of sends would deadlock. They use torch's private schedule helpers (listed in
``src/strategies/lightning_compat.py``); a torch without them gets torch's own classes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    Schedule1F1B,
    ScheduleGPipe,
    get_schedule_class,
)

from src.strategies import lightning_compat as compat
from src.utils.errors import ConfigError

# The schedules this strategy places stages for (torch has more, e.g. zero-bubble ones with "V" placement).
SUPPORTED = ("GPipe", "1F1B", "Interleaved1F1B")


def canonical_schedule(name: str) -> str:
    """The schedule's canonical name, matched case-insensitively; a clear error for unknown names."""
    try:
        cls = get_schedule_class(str(name))
    except ValueError:
        cls = None
    key = next((s for s in SUPPORTED if cls is not None and get_schedule_class(s) is cls), None)
    if key is None:
        raise ConfigError(f"trainer.strategy.schedule={name!r} is unknown: choose one of {', '.join(SUPPORTED)}")
    return key


def is_multi_stage(name: str) -> bool:
    """Schedules that run several (virtual) stages per rank and take a list of stages."""
    return issubclass(get_schedule_class(name), PipelineScheduleMulti)


def check_schedule(name: str, n_microbatches: int, stages_per_rank: int, pp: int | None = None) -> None:
    """Reject schedule settings torch would refuse (or that make no sense) before any process starts.

    ``pp`` (pipeline ranks) is checked too when known.
    """
    if isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int) or n_microbatches < 1:
        raise ConfigError(f"trainer.strategy.n_microbatches={n_microbatches!r} must be an integer >= 1")
    if isinstance(stages_per_rank, bool) or not isinstance(stages_per_rank, int) or stages_per_rank < 1:
        raise ConfigError(f"trainer.strategy.stages_per_rank={stages_per_rank!r} must be an integer >= 1")
    if is_multi_stage(name) and stages_per_rank < 2:
        raise ConfigError(
            f"schedule={name} interleaves several virtual stages per rank: set trainer.strategy.stages_per_rank=2 "
            f"(or more), or use schedule=1F1B"
        )
    if not is_multi_stage(name) and stages_per_rank != 1:
        raise ConfigError(
            f"schedule={name} runs one stage per rank but stages_per_rank={stages_per_rank}: set stages_per_rank=1, "
            f"or use schedule=Interleaved1F1B"
        )
    if pp is None:
        return
    if name == "1F1B" and n_microbatches < pp:
        raise ConfigError(
            f"schedule=1F1B needs n_microbatches >= the number of stages ({pp}), got {n_microbatches}: "
            f"raise trainer.strategy.n_microbatches"
        )
    if name == "Interleaved1F1B":
        rounds = max(1, n_microbatches // pp)
        if n_microbatches % rounds:
            raise ConfigError(
                f"schedule=Interleaved1F1B with {pp} pipeline ranks needs n_microbatches to be a multiple of "
                f"{rounds} (= n_microbatches // ranks), got {n_microbatches}: use a multiple of {pp}"
            )


def stage_indices(pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    """The (virtual) stage indices held by pipeline rank ``pp_rank``: ``pp_rank, pp_rank + pp, ...``."""
    return [pp_rank + k * pp for k in range(stages_per_rank)]


def _post(ops: Sequence[dist.P2POp]) -> list[dist.Work]:
    """Start ``ops`` (each an isend or irecv) without waiting."""
    works = []
    for op in ops:
        if op.op is dist.isend:
            work = dist.isend(op.tensor, dst=op.peer, group=op.group, tag=op.tag)
        else:
            work = dist.irecv(op.tensor, src=op.peer, group=op.group, tag=op.tag)
        if work is not None:
            works.append(work)
    return works


def _wait(works: Sequence[dist.Work]) -> None:
    for work in works:
        work.wait()


class _Prefetching:
    """Single-stage schedule body: the parent schedule's per-rank order, receives posted up front.

    Every micro-batch has its own receive buffer and messages between two ranks arrive in the
    order they were sent, so posting all receives first is safe; sends never block the stage
    (each is waited for at the end of the step), so the order cannot deadlock.
    """

    def _order(self) -> list[tuple[str, int]]:
        raise NotImplementedError

    def _step_microbatches(
        self,
        arg_mbs: list | None = None,
        kwarg_mbs: list | None = None,
        target_mbs: list | None = None,
        losses: list | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
    ) -> None:
        arg_mbs, kwarg_mbs = self._check_inputs(arg_mbs, kwarg_mbs, target_mbs, losses)
        first_target = target_mbs[0] if target_mbs is not None else None
        self._initialize_stage(arg_mbs[0], kwarg_mbs[0], first_target, loss_kwargs)
        stage, m, backward = self._stage, self._n_microbatches, self._has_backward
        fwd_recvs = [_post(stage.get_fwd_recv_ops(i)) for i in range(m)]
        bwd_recvs = [_post(stage.get_bwd_recv_ops(i)) for i in range(m)] if backward else []
        sends: list[dist.Work] = []
        for kind, i in self._order() if backward else [("F", i) for i in range(m)]:
            if kind == "F":
                _wait(fwd_recvs[i])
                output = stage.forward_one_chunk(i, arg_mbs[i], kwarg_mbs[i], save_forward_output=return_outputs)
                sends += _post(stage.get_fwd_send_ops(i))
                self._maybe_compute_loss(stage, output, target_mbs, i, loss_kwargs)
            else:
                _wait(bwd_recvs[i])
                stage.backward_one_chunk(i, loss=self._maybe_get_loss(stage, i), last_backward=i == m - 1)
                sends += _post(stage.get_bwd_send_ops(i))
        _wait(sends)
        self._update_losses(stage, losses)
        if backward:
            stage.perform_reduce_grad(m if self.scale_grads else 1)


class PrefetchGPipe(_Prefetching, ScheduleGPipe):
    """GPipe (all forwards, then all backwards in micro-batch order) with receives posted up front."""

    def _order(self) -> list[tuple[str, int]]:
        m = self._n_microbatches
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


class Prefetch1F1B(_Prefetching, Schedule1F1B):
    """1F1B (``num_stages - stage_index`` warm-up forwards, then alternate) with receives posted up front."""

    def _order(self) -> list[tuple[str, int]]:
        m = self._n_microbatches
        warmup = min(m, self._num_stages - self._stage.stage_index)
        order, next_fwd = [("F", i) for i in range(warmup)], warmup
        for i in range(m):
            order.append(("B", i))
            if next_fwd < m:
                order.append(("F", next_fwd))
                next_fwd += 1
        return order


PREFETCHING = {"GPipe": PrefetchGPipe, "1F1B": Prefetch1F1B}


def _prefetching_class(name: str, group: dist.ProcessGroup) -> type | None:
    """The prefetching class for ``name`` where it is safe (gloo), else None."""
    cls = PREFETCHING.get(name)
    return cls if cls is not None and dist.get_backend(group) == "gloo" else None


def build_schedule(
    name: str,
    modules: Sequence[tuple[int, nn.Module]],
    num_stages: int,
    device: torch.device,
    group: dist.ProcessGroup,
    n_microbatches: int,
    loss_fn: Callable | None,
    prefetch: bool = True,
) -> PipelineScheduleSingle | PipelineScheduleMulti:
    """Wrap this rank's stage modules in ``PipelineStage`` objects and build the named schedule.

    ``loss_fn=None`` builds a forward-only schedule (evaluation). With a loss, gradients are
    scaled by ``1 / n_microbatches`` (``scale_grads``), so a mean-reduced loss per micro-batch
    gives the gradient of the full-batch mean. ``prefetch``: GPipe and 1F1B post their receives
    up front (see module docstring); ``False`` runs torch's own classes.
    """
    stages = [PipelineStage(module, index, num_stages, device, group=group) for index, module in modules]
    schedule_cls = (_prefetching_class(name, group) if prefetch else None) or get_schedule_class(name)
    target = stages if is_multi_stage(name) else stages[0]
    try:
        schedule = schedule_cls(target, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=True)
    except ValueError as err:  # a constraint check_schedule does not know about (newer torch)
        raise ConfigError(f"schedule={name}, n_microbatches={n_microbatches}: {err}") from err
    if schedule_cls in PREFETCHING.values() and not compat.has_pipeline_internals(schedule):
        return build_schedule(name, modules, num_stages, device, group, n_microbatches, loss_fn, prefetch=False)
    return schedule
