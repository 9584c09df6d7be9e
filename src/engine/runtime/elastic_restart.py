"""A torchrun restart (``--max-restarts``) starts its process group in a store namespace of its own.

torchrun's static rendezvous (``--master_port`` without ``--rdzv-backend``) keeps one TCPStore for every
attempt, and ``init_process_group`` writes the group's keys there without an attempt prefix. After a
restart, a rank can read the *previous* attempt's keys, such as gloo's peer addresses or nccl's unique
id, and connect to a process that no longer exists ("Gloo connectFullMesh failed ... Connection
refused"), failing the restart it was meant to make.
"""

from __future__ import annotations

import datetime as dt

import torch
import torch.distributed as dist

from src.engine.runtime.launch_context import launch_context


def init_group_of_this_attempt(backend: str, timeout: dt.timedelta, device: torch.device) -> bool:
    """On a torchrun restart, start the default group under ``attempt_<n>/`` in the agent's store.

    Returns True when it did; Lightning then finds the group initialised and keeps it. A first attempt,
    or a launch without torchrun's agent store, is left to Lightning.
    """
    ctx = launch_context()
    if ctx.restart_count == 0 or not ctx.torchrun_agent_store or dist.is_initialized():
        return False
    store = dist.TCPStore(ctx.master_addr, int(ctx.master_port), is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"attempt_{ctx.restart_count}", store),
                            rank=ctx.rank, world_size=ctx.world_size, timeout=timeout,
                            device_id=device if device.type != "cpu" else None)
    return True
