"""Running metrics resumed on another number of ranks: the new ranks' synced value is the saved ranks' one,
whatever values the saved states hold (``src/engine/checkpointing/resume_state.py``). The sync is summed by hand
here as torchmetrics sums it across ranks; ``tests/test_world_sizes.py`` runs it with real processes."""

from __future__ import annotations

import pytest
import torch
from torchmetrics import MaxMetric

from src.engine.checkpointing.resume_state import _take_from_other_replicas
from src.engine.steps.metrics import SampleMean


def saved_mean(*batches: tuple[float, int]) -> dict:
    """One saved rank's ``SampleMean`` state after ``(batch mean, samples)`` updates."""
    metric = SampleMean()
    for value, n in batches:
        metric.update(torch.tensor(value), n)
    return {k: v.clone() for k, v in metric.metric_state.items()}


def resumed(metric_class, saved: list[dict], world_size: int) -> list:
    metrics = [metric_class() for _ in range(world_size)]
    for rank, metric in enumerate(metrics):
        _take_from_other_replicas(metric, saved, rank)
    return metrics


def summed_mean(metrics: list[SampleMean]) -> float:
    total = sum(m.total for m in metrics)
    count = sum(m.count for m in metrics)
    return float(total / count)


@pytest.mark.fast
@pytest.mark.parametrize(("saved", "world_size"), [
    ([saved_mean((2.0, 4), (4.0, 4))], 3),  # one process resumed on 3 ranks
    ([saved_mean((1.0, 2)), saved_mean((1.0, 2))], 1),  # 2 ranks with equal sums resumed on 1
    ([saved_mean((1.0, 2)), saved_mean((3.0, 2)), saved_mean((5.0, 4)), saved_mean((7.0, 4))], 2),
], ids=["1-on-3", "2-equal-on-1", "4-on-2"])
def test_an_epochs_running_mean_is_counted_once_on_any_number_of_ranks(saved, world_size):
    whole = summed_mean([_with_state(SampleMean(), s) for s in saved])
    metrics = resumed(SampleMean, saved, world_size)
    assert summed_mean(metrics) == pytest.approx(whole)
    assert sum(int(m.count) for m in metrics) == sum(int(s["count"]) for s in saved)


@pytest.mark.fast
@pytest.mark.parametrize("world_size", [1, 3])
def test_a_best_so_far_tracker_is_whole_on_every_rank(world_size):
    saved = [{"max_value": torch.tensor(0.8)}, {"max_value": torch.tensor(0.8)}]  # synced values: alike on each rank
    assert [float(m.compute()) for m in resumed(MaxMetric, saved, world_size)] == pytest.approx([0.8] * world_size)
    unequal = [{"max_value": torch.tensor(0.7)}, {"max_value": torch.tensor(0.8)}]
    assert [float(m.compute()) for m in resumed(MaxMetric, unequal, world_size)] == pytest.approx([0.8] * world_size)


def _with_state(metric, state: dict):
    for key, value in state.items():
        setattr(metric, key, value)
    return metric
