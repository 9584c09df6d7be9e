"""Run a function in N real processes joined by a gloo process group, and collect per-rank results.

Tests use this to prove distributed behaviour on CPU: every worker is a separate
process, forked from a fresh server process that has imported torch and Lightning once
(multiprocessing's forkserver), so no state leaks from pytest and no worker pays those imports
again; results come back by rank.
"""

from __future__ import annotations

import os
import pickle
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

# Imported once by the fork server; each worker starts from them already in memory.
_PRELOAD = ["torch", "torch.distributed", "lightning.pytorch"]


def _worker(rank: int, world_size: int, port: int, env: dict, fn: Callable, args: tuple, queue: Any) -> None:
    import torch.distributed as dist

    os.environ.clear()  # the caller's environment now, as a spawned process would see it, not the server's
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        # Plain pickle bytes: torch's queue pickler would share tensors through file descriptors
        # that vanish when this process exits before the parent reads them.
        queue.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # report any failure to the parent instead of hanging it
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_workers(fn: Callable, world_size: int, *args: Any, timeout: float = 180) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results ordered by rank.

    ``fn`` must be importable (module level): workers receive it pickled. A worker's
    exception is re-raised here with its traceback.
    """
    from lightning.fabric.plugins.environments.lightning import find_free_network_port

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # takes effect when this process first starts its fork server
    queue = ctx.Queue()
    port = find_free_network_port()
    env = dict(os.environ)
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, env, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world_size):
            rank, ok, value = queue.get(timeout=timeout)
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world_size)]
