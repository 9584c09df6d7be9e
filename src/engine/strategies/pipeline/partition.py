"""Split a net's ordered named blocks into contiguous, balanced pipeline stages, and show the split.

Every project net is an ``nn.Sequential`` whose named children are its blocks. A stage is a
contiguous run of blocks; the split minimises the cost of the most expensive stage (the
pipeline runs at the pace of its slowest stage). The cost of a block is its parameter count
(``balance="params"``) or its measured forward time (``balance="time"``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from rich.table import Table
from torch import Tensor, nn

from src.engine.utils.errors import ConfigError

BALANCE_MODES = ("params", "time")


@dataclass(frozen=True)
class StageSpec:
    """One pipeline stage: its index, its blocks (in order), their parameters and the cost used to balance."""

    index: int
    blocks: tuple[str, ...]
    params: int
    cost: float


def named_blocks(net: nn.Module) -> list[tuple[str, nn.Module]]:
    """The ordered ``(name, block)`` pairs of a sequential net; a clear error for anything else."""
    if not isinstance(net, nn.Sequential):
        raise ConfigError(
            f"trainer=pipeline splits model.net by its named blocks, and it is a {type(net).__name__}; fix: "
            "build the net as an nn.Sequential of named blocks"
        )
    return list(net.named_children())


def param_costs(blocks: Sequence[tuple[str, nn.Module]]) -> list[float]:
    """Parameter count of every block (shared parameters count once, in the first block holding them)."""
    seen: set[int] = set()
    costs = []
    for _, block in blocks:
        own = [p for p in block.parameters() if id(p) not in seen]
        seen.update(id(p) for p in own)
        costs.append(float(sum(p.numel() for p in own)))
    return costs


@torch.no_grad()
def time_costs(blocks: Sequence[tuple[str, nn.Module]], example: Tensor, repeats: int = 5) -> list[float]:
    """Median forward time (seconds) of every block on ``example``'s device, the blocks run in sequence.

    Blocks may live on the host: each is moved to ``example``'s device only while it is timed and
    then moved back, so at most one block occupies the device (the model need not fit on it).
    Runs in eval mode under ``no_grad`` so that timing neither updates BatchNorm statistics nor
    draws dropout random numbers (which would desynchronise the ranks' RNG streams).
    """
    sync = torch.cuda.synchronize if example.is_cuda else (lambda: None)
    costs, x = [], example
    for _, block in blocks:
        home = next(iter(block.parameters()), x).device
        modes = [(m, m.training) for m in block.modules()]
        block.eval().to(x.device)
        samples = []
        try:
            for rep in range(repeats + 1):  # the first pass is warm-up
                sync()
                start = time.perf_counter()
                out = block(x)
                sync()
                if rep:
                    samples.append(time.perf_counter() - start)
        finally:
            block.to(home)
            for module, training in modes:
                module.training = training
        costs.append(statistics.median(samples))
        x = out
    return costs


def balanced_split(costs: Sequence[float], n_stages: int) -> list[range]:
    """Contiguous split of ``costs`` into ``n_stages`` non-empty parts minimising the largest part's sum.

    Hand-written (no library offers it): the classic linear-partition dynamic programme,
    O(n_stages * n^2), which is nothing for a few dozen blocks. Ties keep earlier stages
    smaller, so the split is deterministic and identical on every rank.
    """
    n = len(costs)
    if n_stages < 1:
        raise ConfigError(f"the pipeline has {n_stages} stages; fix: give it 1 or more")
    if n < n_stages:
        raise ConfigError(
            f"model.net has {n} blocks but the pipeline needs {n_stages} stages (one block at least each); fix: "
            f"use fewer trainer.strategy.stages / stages_per_rank, or a net with more blocks"
        )
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][j]: smallest possible max-stage cost of blocks[:j] in k stages; cut[k][j]: where stage k starts.
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, n_stages + 1):
        for j in range(k, n - (n_stages - k) + 1):
            for i in range(k - 1, j):
                value = max(best[k - 1][i], prefix[j] - prefix[i])
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    bounds, j = [], n
    for k in range(n_stages, 0, -1):
        i = cut[k][j]
        bounds.append(range(i, j))
        j = i
    return bounds[::-1]


def plan_stages(net: nn.Module, n_stages: int, costs: Sequence[float] | None = None) -> list[StageSpec]:
    """Split ``net`` into ``n_stages`` stages balanced by ``costs`` (default: parameter counts)."""
    blocks = named_blocks(net)
    params = param_costs(blocks)
    costs = list(costs) if costs is not None else params
    if len(costs) != len(blocks):
        raise ValueError(f"{len(costs)} costs for {len(blocks)} blocks")
    return [
        StageSpec(
            index=s,
            blocks=tuple(blocks[i][0] for i in part),
            params=int(sum(params[i] for i in part)),
            cost=float(sum(costs[i] for i in part)),
        )
        for s, part in enumerate(balanced_split(costs, n_stages))
    ]


def split_table(plan: Sequence[StageSpec], ranks: Sequence[Sequence[int]], balance: str) -> Table:
    """A rich table of the split: stage, blocks, parameters, balancing cost and the global ranks holding it."""
    table = Table(title=f"Pipeline split ({len(plan)} stages, balanced by {balance})")
    for column in ("stage", "blocks", "params", "time (ms)" if balance == "time" else "share", "rank(s)"):
        table.add_column(column, justify="left" if column == "blocks" else "right")
    total = sum(s.cost for s in plan) or 1.0
    for spec, holders in zip(plan, ranks, strict=True):
        cost = f"{spec.cost * 1e3:.2f}" if balance == "time" else f"{spec.cost / total:.0%}"
        table.add_row(str(spec.index), ", ".join(spec.blocks), f"{spec.params:,}", cost,
                      ", ".join(map(str, holders)))
    return table
