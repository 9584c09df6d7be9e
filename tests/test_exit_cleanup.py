"""A rank that returns right after a collective must exit cleanly (src.engine.runtime.exit_cleanup), and a
spawned rank ends without the interpreter's teardown (src.engine.runtime.prompt_exit).

Without the exit handler a gloo rank can die with SIGABRT while Python shuts down: a process
group's worker thread still releases the last collective's tensors and needs the GIL. The race
itself is rare, so these tests check its precondition directly: after the exit handlers have run,
no gloo worker thread may be left (Linux: thread names from /proc/self/task).
"""

from __future__ import annotations

import atexit
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.fabric.plugins.environments.lightning import find_free_network_port
from lightning.pytorch.utilities.exceptions import SIGTERMException

from src.engine.strategies.launchers import SpawnedRank
from tests.helpers import teardown_probe

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")


def gloo_threads() -> int:
    """Threads of this process that belong to a gloo process group (``pt_gloo_runloop``, ``gloo...``)."""
    names = (Path(f"/proc/self/task/{tid}/comm").read_text() for tid in os.listdir("/proc/self/task"))
    return sum("gloo" in name for name in names)


def _strategy(kind: str):
    from lightning.pytorch.accelerators import CPUAccelerator
    from lightning.pytorch.plugins.environments import LightningEnvironment

    from src.engine.strategies.ddp import DDPStrategy
    from src.engine.strategies.pipeline.strategy import PipelineStrategy

    if kind == "fsdp":  # Lightning's ModelParallelStrategy takes these from the Trainer, not its constructor
        from lightning.pytorch.demos.boring_classes import BoringModel

        from src.engine.strategies.fsdp import FSDPStrategy

        strategy = FSDPStrategy(process_group_backend="gloo")
        strategy.accelerator, strategy.cluster_environment = CPUAccelerator(), LightningEnvironment()
        strategy.parallel_devices = [torch.device("cpu")] * 2
        strategy.connect(BoringModel())  # its setup_environment hands the module the device mesh
        return strategy
    cls = {"ddp": DDPStrategy, "pipeline": PipelineStrategy}[kind]
    return cls(accelerator=CPUAccelerator(), parallel_devices=[torch.device("cpu")] * 2,
               cluster_environment=LightningEnvironment(), process_group_backend="gloo")


def rank_syncs_then_exits(local_rank: int, port: int, kind: str) -> None:
    """One rank: set up the groups through the project's strategy, run a collective, then exit."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(local_rank))
    strategy = _strategy(kind)
    strategy.setup_environment()  # the process group (and, for the pipeline and fsdp, a mesh of sub-groups)
    gathered = [torch.empty(1000) for _ in range(2)]
    dist.all_gather(gathered, torch.full((1000,), float(local_rank)),
                    group=strategy._mesh.pp_group if kind == "pipeline" else None)
    assert [t[0].item() for t in gathered] == [0.0, 1.0]
    assert gloo_threads() > 0
    atexit._run_exitfuncs()  # what interpreter exit runs first; `strategy` is still referenced here
    assert not dist.is_initialized(), "no exit handler destroyed the process group"
    assert gloo_threads() == 0, f"{gloo_threads()} gloo threads outlive the exit handlers"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ddp", "pipeline", "fsdp"])
def test_no_gloo_thread_outlives_the_exit_handlers(kind):
    # A rank that dies with a signal raises ProcessExitedException; a failed assert, ProcessRaisedException.
    mp.start_processes(rank_syncs_then_exits, args=(find_free_network_port(), kind), nprocs=2, start_method="spawn")


def rank_ends(local_rank: int, directory: str, endings: list[str]) -> None:
    """A rank's work under the spawn launcher's wrapper: hold what only the teardown frees, register an exit
    handler, then end as ``endings[local_rank]`` says."""
    teardown_probe.hold(Path(directory, f"{local_rank}.freed"))
    atexit.register(Path(directory, f"{local_rank}.atexit").write_text, "ran")
    if endings[local_rank] == "stop":
        raise SIGTERMException()  # the agreed stop: the parent reads 143
    if endings[local_rank] == "error":
        raise ValueError("boom")  # torch's spawn wrapper reports it and exits 1


@pytest.mark.slow
def test_a_spawned_rank_keeps_its_status_and_exit_handlers_and_skips_the_teardown(tmp_path):
    """The teardown is where a finished gloo rank can abort (docs/faults.md, Clean exit); what the exit
    guarantees stays: each ending's status, and the handlers the rank registered."""
    context = mp.start_processes(SpawnedRank(rank_ends, None), args=(str(tmp_path), ["return", "stop", "error"]),
                                 nprocs=3, start_method="spawn", join=False)
    try:
        for process in context.processes:
            process.join(120)
        assert [p.exitcode for p in context.processes] == [0, 143, 1]
        assert sorted(path.name for path in tmp_path.iterdir() if path.read_text()) == ["0.atexit", "1.atexit",
                                                                                       "2.atexit"]
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
