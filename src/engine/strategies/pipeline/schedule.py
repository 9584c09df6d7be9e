"""Pipeline schedules by name, their constraints, and building ``PipelineStage`` objects plus a schedule.

All of it is ``torch.distributed.pipelining``: names resolve through torch's own registry
(``get_schedule_class``), multi-stage schedules are recognised by their base class
(``PipelineScheduleMulti``), and virtual stages are placed the way the interleaved schedule expects
("loop" placement: stage ``i`` lives on pipeline rank ``i % pp``). This module checks the
constraints torch would otherwise report late, after the processes are up.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    get_schedule_class,
)

from src.engine.utils.errors import ConfigError

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
        raise ConfigError(f"trainer.strategy.schedule={name!r} is unknown; fix: choose one of {', '.join(SUPPORTED)}")
    return key


def is_multi_stage(name: str) -> bool:
    """Schedules that run several (virtual) stages per rank and take a list of stages."""
    return issubclass(get_schedule_class(name), PipelineScheduleMulti)


def check_schedule(name: str, n_microbatches: int, stages_per_rank: int, pp: int | None = None) -> None:
    """Reject schedule settings torch would refuse (or that make no sense) before any process starts.

    ``pp`` (pipeline ranks) is checked too when known.
    """
    if isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int) or n_microbatches < 1:
        raise ConfigError(f"trainer.strategy.n_microbatches={n_microbatches!r} is not an integer >= 1; fix: set one")
    if isinstance(stages_per_rank, bool) or not isinstance(stages_per_rank, int) or stages_per_rank < 1:
        raise ConfigError(f"trainer.strategy.stages_per_rank={stages_per_rank!r} is not an integer >= 1; fix: set one")
    if is_multi_stage(name) and stages_per_rank < 2:
        raise ConfigError(
            f"schedule={name} interleaves several virtual stages per rank; fix: set trainer.strategy.stages_per_rank=2 "
            f"(or more), or use schedule=1F1B"
        )
    if not is_multi_stage(name) and stages_per_rank != 1:
        raise ConfigError(
            f"schedule={name} runs one stage per rank but stages_per_rank={stages_per_rank}; fix: set stages_per_rank=1, "
            f"or use schedule=Interleaved1F1B"
        )
    if pp is None:
        return
    if name == "1F1B" and n_microbatches < pp:
        raise ConfigError(
            f"schedule=1F1B needs n_microbatches >= the number of stages ({pp}), got {n_microbatches}; fix: "
            f"raise trainer.strategy.n_microbatches"
        )
    if name == "Interleaved1F1B":
        rounds = max(1, n_microbatches // pp)
        if n_microbatches % rounds:
            raise ConfigError(
                f"schedule=Interleaved1F1B with {pp} pipeline ranks needs n_microbatches to be a multiple of "
                f"{rounds} (= n_microbatches // ranks), got {n_microbatches}; fix: use a multiple of {pp}"
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
) -> PipelineScheduleSingle | PipelineScheduleMulti:
    """Wrap this rank's stage modules in ``PipelineStage`` objects and build the named schedule.

    ``loss_fn=None`` builds a forward-only schedule (evaluation). With a loss, gradients are
    scaled by ``1 / n_microbatches`` (``scale_grads``), so a mean-reduced loss per micro-batch
    gives the gradient of the full-batch mean.
    """
    stages = [PipelineStage(module, index, num_stages, device, group=group) for index, module in modules]
    schedule_cls = get_schedule_class(name)
    target = stages if is_multi_stage(name) else stages[0]
    try:
        schedule = schedule_cls(target, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=True)
    except ValueError as err:  # a constraint check_schedule does not know about (newer torch)
        raise ConfigError(f"schedule={name}, n_microbatches={n_microbatches}: {err}; fix: choose another schedule or n_microbatches") from err
    return schedule
