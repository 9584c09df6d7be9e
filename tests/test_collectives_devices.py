"""Collectives on GPUs: what nccl demands, checked on CPU where it can be, and on real GPUs when present.

nccl differs from gloo in three ways that matter here: it takes tensors on the group's GPU only (no CPU
backend), it runs each rank's point-to-point calls in order on one stream (a receive posted before the
matching send blocks that rank's later sends), and each process may see only its own GPU
(``CUDA_VISIBLE_DEVICES``). The CPU tests fake the first two on gloo (``tests/helpers/collectives_workers.py``)
and monkeypatch the third; the GPU tests run the real thing and skip without CUDA.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments.lightning import find_free_network_port

from src.engine.collectives import launch, runtime
from src.engine.collectives.benchmark import MEMCPY, BenchRow
from src.engine.collectives.report import bench_table, memcpy_label
from tests.helpers import collectives_workers as workers
from tests.helpers.multiprocess import run_workers
from tests.helpers.run_if import requires_2_gpus, requires_nccl

ROOT = Path(__file__).resolve().parents[1]


# ====================================================================== CPU: which GPU a rank uses

@pytest.mark.fast
@pytest.mark.parametrize(("local_rank", "visible", "index"), [(0, 1, 0), (3, 1, 0), (1, 2, 1), (3, 2, 1), (5, 8, 5)])
def test_cuda_index_counts_only_the_visible_gpus(local_rank, visible, index):
    assert runtime.cuda_index(local_rank, visible) == index


@pytest.mark.fast
def test_cuda_index_without_a_gpu_says_so():
    with pytest.raises(RuntimeError, match="no CUDA device"):
        runtime.cuda_index(0, 0)


@pytest.mark.fast
def test_one_visible_gpu_per_process_is_cuda_0(monkeypatch):
    """``srun --gpus-per-task=1``: LOCAL_RANK 1 sees one GPU, which is cuda:0 (cuda:1 does not exist)."""
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(runtime, "backend_name", lambda group=None: "nccl")
    assert runtime.comm_device() == torch.device("cuda", 0)

    class Joined(Exception):
        pass

    def init_process_group(**kwargs):
        raise Joined

    chosen = []
    for var in ("RANK", "WORLD_SIZE"):  # run_rank exports them; restore them after the test
        monkeypatch.setenv(var, "0")
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    plan = launch.LaunchPlan("check", "nccl", 2, "env://", 10.0, "unused")
    with pytest.raises(Joined):
        launch.run_rank(1, plan, rank=1, world_size=2)
    assert chosen == [0]


@pytest.mark.fast
def test_gpu_memcpy_is_labelled_as_a_copy_inside_one_gpu():
    assert "intra-GPU" in memcpy_label("cuda") and "intra-GPU" not in memcpy_label("cpu")
    rows = [BenchRow(op, 4096, 2, "nccl", "float32", 2, 10.0, 1.0, 1.0, device="cuda")
            for op in ("all_reduce", MEMCPY)]
    ops_column = [str(cell) for cell in bench_table(rows).columns[1].cells]
    assert any("intra-GPU" in cell for cell in ops_column), ops_column


# ====================================================================== CPU: only device tensors reach a collective

@pytest.mark.slow
def test_every_call_site_hands_collectives_device_tensors_only(tmp_path):
    """On a group that, like nccl, takes tensors on its device only, no call site hands it a host tensor:
    every mode of ``python -m src.engine.collectives``, both ring schedules and the callback."""
    results = run_workers(workers.device_discipline, 2, str(tmp_path), timeout=300)
    for per_rank in results:
        assert per_rank["violations"] == []
        assert per_rank["control"] and "host tensor" in per_rank["control"][0]  # the fake does catch one
        reached = {Path(c).name for c in per_rank["callers"]}
        assert {"suite.py", "benchmark.py", "ring.py", "sync_sgd.py", "demos.py"} <= reached
        assert per_rank["callback_bench_rows"] > 0
    assert json.loads((tmp_path / "collectives.json").read_text())["runs"][0]["checks"]["counts"]["failed"] == 0


# ====================================================================== CPU: point-to-point order that nccl can run

def _units(log: list) -> list[list[tuple[str, int]]]:
    return [list(entry[1]) if entry[0] == "batch" else [entry] for entry in log]


def _deadlocked_ranks(logs: list[list]) -> list[int]:
    """Replay every rank's point-to-point calls as nccl runs them: one stream per rank, so a call (or a
    whole ``batch_isend_irecv``) starts when the previous one has finished, and a send finishes only with
    its receive (no eager buffering: the worst case). Returns the ranks left waiting forever."""
    queues = [_units(log) for log in logs]
    while True:
        progressed = False
        for rank, queue in enumerate(queues):
            if not queue:
                continue
            for kind, peer in list(queue[0]):
                if kind != "send" or not queues[peer]:
                    continue
                match = next((op for op in queues[peer][0] if op == ("recv", rank)), None)
                if match is not None:
                    queue[0].remove((kind, peer))
                    queues[peer][0].remove(match)
                    progressed = True
        for queue in queues:
            while queue and not queue[0]:
                queue.pop(0)
                progressed = True
        if not progressed:
            return [rank for rank, queue in enumerate(queues) if queue]


@pytest.mark.fast
def test_replay_finds_the_receive_first_deadlock():
    both_receive_first = [[("recv", 1), ("send", 1)], [("recv", 0), ("send", 0)]]
    assert _deadlocked_ranks(both_receive_first) == [0, 1]
    assert _deadlocked_ranks([[("send", 1), ("recv", 1)], [("recv", 0), ("send", 0)]]) == []
    assert _deadlocked_ranks([[("batch", [("recv", 1), ("send", 1)])], [("batch", [("recv", 0), ("send", 0)])]]) == []


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_point_to_point_order_cannot_deadlock_on_nccl(world_size):
    """isend/irecv check, both ring schedules (as chosen on nccl), the demos: replayed with nccl's
    in-order semantics, no rank waits forever."""
    logs = run_workers(workers.p2p_orders, world_size, timeout=240)
    for site in logs[0]:
        per_rank = [logs[rank][site] for rank in range(world_size)]
        assert any(per_rank), site  # the site did post point-to-point calls
        assert _deadlocked_ranks(per_rank) == [], f"{site} deadlocks on nccl: {per_rank}"


# ====================================================================== GPU (skipped without CUDA)

def _run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "src.engine.collectives", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


GPU_MODES = [
    ("check", []),
    ("bench", ["bench.sizes=[4KB,64KB]", "bench.warmup=1", "bench.iters=2"]),
    ("ring", ["ring.numels=[0,7,1000]", "ring.bench_sizes=[64KB]", "ring.warmup=1", "ring.iters=2"]),
    ("sgd", ["sgd.steps=2", "sgd.epochs=1"]),
]


def _assert_mode_ran_on_nccl(mode: str, nproc: int, out: Path, proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    saved = json.loads((out / f"collectives_{mode}.json").read_text())
    assert (saved.get("meta") or saved)["backend"] == "nccl"
    if mode == "check":
        assert saved["counts"]["failed"] == 0 and saved["world_size"] == nproc
    elif mode == "bench":
        rows = saved["rows"]
        assert {r["op"] for r in rows} >= {"all_reduce", "ring_all_reduce", MEMCPY}
        # busbw = algbw x 2(n-1)/n is 0 for all_reduce on one rank (nccl-tests' definition): check algbw there
        assert all(r["device"] == "cuda" and r["algbw_GBps"] > 0 for r in rows)
        assert nproc == 1 or all(r["busbw_GBps"] > 0 for r in rows)
        assert "intra-GPU" in proc.stdout
    elif mode == "ring":
        assert all(c["equal"] for c in saved["cases"]) and saved["rows"]
    else:
        assert saved["max_grad_diff"] <= 1e-6 and saved["max_param_diff"] <= 1e-6


@pytest.mark.gpu
@pytest.mark.slow
@requires_nccl
@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=requires_2_gpus)])
@pytest.mark.parametrize(("mode", "args"), GPU_MODES, ids=[m for m, _ in GPU_MODES])
def test_modes_on_nccl_ranks(mode, args, nproc, tmp_path):
    proc = _run_cli(f"mode={mode}", f"nproc={nproc}", "backend=nccl", f"hydra.run.dir={tmp_path}", *args)
    _assert_mode_ran_on_nccl(mode, nproc, tmp_path, proc)


@pytest.mark.gpu
@pytest.mark.slow
@requires_nccl
@requires_2_gpus
def test_isend_irecv_and_pipelined_ring_on_two_nccl_ranks():
    """The two call sites that post a receive and a send to the same peer (a hang on nccl when unordered)."""
    for per_rank in run_workers(workers.nccl_p2p, 2, find_free_network_port(), timeout=180):
        assert per_rank["checks"] == [("send_recv", "passed"), ("isend_irecv", "passed"),
                                      ("batch_isend_irecv", "passed")]
        assert per_rank["ring"] == {"pipelined": True, "stepwise": True, "default": True}
