"""Pipeline schedules by name, their constraints, and building ``PipelineStage`` objects plus a schedule.

All of it is ``torch.distributed.pipelining``: this module only maps config names to its
schedule classes, checks the constraints those classes would otherwise report late (after
the processes are up), and places virtual stages on ranks the way the interleaved schedule
expects ("loop" placement: stage ``i`` lives on pipeline rank ``i % pp``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.pipelining.schedules import _PipelineSchedule

from src.utils.errors import ConfigError

SCHEDULES: dict[str, type[_PipelineSchedule]] = {
    "GPipe": ScheduleGPipe,
    "1F1B": Schedule1F1B,
    "Interleaved1F1B": ScheduleInterleaved1F1B,
}
# Schedules that run several (virtual) stages per rank and take a list of stages.
MULTI_STAGE = frozenset({"Interleaved1F1B"})


def canonical_schedule(name: str) -> str:
    """The schedule's canonical name, matched case-insensitively; a clear error for unknown names."""
    by_lower = {key.lower(): key for key in SCHEDULES}
    key = by_lower.get(str(name).lower().replace("_", "").replace("-", ""))
    if key is None:
        raise ConfigError(f"trainer.strategy.schedule={name!r} is unknown: choose one of {', '.join(SCHEDULES)}")
    return key


def check_schedule(name: str, n_microbatches: int, stages_per_rank: int, pp: int | None = None) -> None:
    """Reject schedule settings torch would refuse (or that make no sense) before any process starts.

    ``pp`` (pipeline ranks) is checked too when known.
    """
    if isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int) or n_microbatches < 1:
        raise ConfigError(f"trainer.strategy.n_microbatches={n_microbatches!r} must be an integer >= 1")
    if isinstance(stages_per_rank, bool) or not isinstance(stages_per_rank, int) or stages_per_rank < 1:
        raise ConfigError(f"trainer.strategy.stages_per_rank={stages_per_rank!r} must be an integer >= 1")
    if name in MULTI_STAGE and stages_per_rank < 2:
        raise ConfigError(
            f"schedule={name} interleaves several virtual stages per rank: set trainer.strategy.stages_per_rank=2 "
            f"(or more), or use schedule=1F1B"
        )
    if name not in MULTI_STAGE and stages_per_rank != 1:
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


def build_schedule(
    name: str,
    modules: Sequence[tuple[int, nn.Module]],
    num_stages: int,
    device: torch.device,
    group: dist.ProcessGroup,
    n_microbatches: int,
    loss_fn: Callable | None,
) -> _PipelineSchedule:
    """Wrap this rank's stage modules in ``PipelineStage`` objects and build the named schedule.

    ``loss_fn=None`` builds a forward-only schedule (evaluation). With a loss, gradients are
    scaled by ``1 / n_microbatches`` (``scale_grads``), so a mean-reduced loss per micro-batch
    gives the gradient of the full-batch mean.
    """
    stages = [PipelineStage(module, index, num_stages, device, group=group) for index, module in modules]
    schedule_cls = SCHEDULES[name]
    target = stages if name in MULTI_STAGE else stages[0]
    try:
        return schedule_cls(target, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=True)
    except ValueError as err:  # a constraint check_schedule does not know about (newer torch)
        raise ConfigError(f"schedule={name}, n_microbatches={n_microbatches}: {err}") from err
