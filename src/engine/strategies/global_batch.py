"""The global-batch rule, in one place: how a global batch splits over a strategy's replicas.

``data.batch_size`` is the global batch. Each data-parallel replica (a DDP rank, or one replica of a
whole pipeline) gets ``batch_size / replicas``, and a pipeline cuts that into ``n_microbatches``.
dp is one process: it takes the whole global batch and splits it over its devices, one sample each at least.
"""

from __future__ import annotations

from typing import Any

from src.engine.utils.errors import ConfigError


def data_replica(strategy: Any) -> tuple[int, int]:
    """``(data-parallel replicas, this process's replica)`` of ``strategy``: every stage of one pipeline is one
    replica; one process (dp, a single device) is one replica."""
    kwargs = getattr(strategy, "distributed_sampler_kwargs", None) or {}
    return int(kwargs.get("num_replicas", 1)), int(kwargs.get("rank", 0))


def per_replica_batch_size(global_batch: int, strategy: Any) -> int:
    """``global_batch // replicas`` for ``strategy``; a ConfigError naming a batch size that works."""
    replicas, _ = data_replica(strategy)
    micro = int(getattr(strategy, "n_microbatches", 1))
    devices = len(getattr(strategy, "parallel_devices", None) or []) if replicas == 1 else 1
    unit = replicas * micro
    if global_batch % unit:
        split = f"{replicas} data-parallel replica(s)" + (f" x {micro} micro-batches" if micro > 1 else "")
        raise ConfigError(f"data.batch_size={global_batch} is the global batch and must divide evenly across {split}; fix: "
                          f"use a multiple of {unit}")
    if getattr(strategy, "strategy_name", None) == "dp":
        check_dp_batch(global_batch, devices)
    return global_batch // replicas


def check_dp_batch(batch: Any, devices: int) -> None:
    """dp splits each batch over its devices, whatever a DataModule means by batch size: one sample each at least."""
    if isinstance(batch, int) and not isinstance(batch, bool) and 0 < batch < devices:
        raise ConfigError(f"data.batch_size={batch} cannot give each of the {devices} dp devices a sample; fix: raise "
                          f"data.batch_size to {devices} or more, or lower trainer.devices to {batch}")
