"""Collectives: correctness suite, ring all-reduce, hand-written sync SGD, benchmark, callback, entry point.

Multi-process tests run real gloo ranks (``tests.helpers.multiprocess.run_workers``); to keep start-up
costs down one spawn runs many checks and returns everything the assertions need. The rank functions are
in ``tests/helpers/collectives_workers.py``.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import pickle
import shlex
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments.lightning import find_free_network_port
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from src.engine.collectives.benchmark import (
    BenchRow,
    busbw_factor,
    format_size,
    parse_size,
    size_sweep,
)
from src.engine.collectives.callback import CollectivesCheck
from src.engine.collectives.checks import (
    FAILED,
    PASSED,
    SKIPPED,
    Check,
    CheckResult,
    merge_results,
    select_checks,
)
from src.engine.collectives.launch import plan_from_config
from src.engine.collectives.report import save_benchmark
from src.engine.collectives.ring import chunk_bounds
from src.engine.collectives.runtime import all_gather_tensor
from src.engine.collectives.suite import (
    ALL_CHECKS,
    BITWISE_OPS,
    CHECK_NAMES,
    reduction_expected,
    reduction_input,
)
from src.engine.collectives.sync_sgd import DataPartitioner, partition_dataset
from src.engine.strategies.ddp import DDPStrategy
from src.engine.utils.errors import ConfigError
from tests.helpers import collectives_workers as workers
from tests.helpers.docs import assert_no_error_line, docs_command
from tests.helpers.multiprocess import run_workers
from tests.helpers.run_if import requires_2_gpus, requires_nccl

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ====================================================================== single-process (fast)

@pytest.mark.fast
@pytest.mark.parametrize("numel", [0, 1, 2, 5, 7, 1000])
@pytest.mark.parametrize("parts", [1, 2, 3, 8])
def test_chunk_bounds_cover_evenly(numel, parts):
    b = chunk_bounds(numel, parts)
    sizes = [hi - lo for lo, hi in zip(b[:-1], b[1:], strict=True)]
    assert b[0] == 0 and b[-1] == numel and len(sizes) == parts
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.fast
@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("op", ["SUM", "PRODUCT", "MIN", "MAX", "AVG", *BITWISE_OPS])
def test_closed_forms_match_a_direct_fold(n, op):
    """The suite's closed forms agree with folding every rank's input by hand."""
    dtype = torch.int64 if op in BITWISE_OPS else torch.float64
    inputs = [reduction_input(op, r, n, dtype, torch.device("cpu")) for r in range(n)]
    fold = {"SUM": torch.add, "PRODUCT": torch.mul, "MIN": torch.minimum, "MAX": torch.maximum,
            "AVG": torch.add, "BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[op]
    direct = functools.reduce(fold, inputs)
    if op == "AVG":
        direct = direct / n
    assert torch.equal(reduction_expected(op, n, dtype), direct)


@pytest.mark.fast
def test_sizes_and_bus_factors():
    assert size_sweep() == [1024 * 4**k for k in range(9)]  # 1KB .. 64MB in powers of 4
    assert [parse_size(s) for s in ("1KB", "16M", "2GiB", 512)] == [1024, 16 << 20, 2 << 30, 512]
    assert [format_size(s) for s in (1024, 1 << 20, (1 << 20) - 4)] == ["1KB", "1MB", "1MB"]
    for bad in ("1XB", "-1", "0"):
        with pytest.raises(ValueError):
            parse_size(bad)
    assert busbw_factor("all_reduce", 4) == pytest.approx(1.5)
    assert busbw_factor("ring_all_reduce", 2) == 1.0
    assert busbw_factor("all_gather", 4) == busbw_factor("reduce_scatter", 4) == busbw_factor("all_to_all", 4) == 0.75
    assert busbw_factor("broadcast", 8) == busbw_factor("reduce", 8) == busbw_factor("memcpy", 8) == 1.0


@pytest.mark.fast
def test_tensor_forms_avoid_deprecated_names():
    if hasattr(dist, "all_gather_single"):
        assert all_gather_tensor is dist.all_gather_single
    names = set(CHECK_NAMES)
    assert {"all_gather", "reduce_scatter", "all_to_all", "all_to_all_single", "scatter", "gather"} <= names
    assert ("all_gather_single" in names) == hasattr(dist, "all_gather_single")


@pytest.mark.fast
def test_merge_marks_an_op_failed_when_any_rank_failed():
    rank0 = [CheckResult("x", PASSED, [0], "[1]", "[1]"), CheckResult("y", SKIPPED, [0], reason="r")]
    rank1 = [CheckResult("x", FAILED, [1], "[1]", "[2]", failed_ranks=[1]), CheckResult("y", SKIPPED, [1], reason="r")]
    merged = {r.op: r for r in merge_results([rank0, rank1])}
    assert merged["x"].status == FAILED and merged["x"].failed_ranks == [1] and merged["x"].ranks == [0, 1]
    assert "expected [1]" in merged["x"].describe() and "received [2]" in merged["x"].describe()
    assert merged["y"].status == SKIPPED
    with pytest.raises(ValueError, match="unknown collective"):
        select_checks(ALL_CHECKS, ["no_such_op"])
    assert {c.collective for c in select_checks(ALL_CHECKS, ["all_reduce"])} == {"all_reduce"}


@pytest.mark.fast
def test_partitioner_is_deterministic_and_disjoint():
    data = list(range(103))
    shards = [partition_dataset(data, r, 4, seed=7) for r in range(4)]
    items = [set(s[i] for i in range(len(s))) for s in shards]
    assert all(len(s) == 103 // 4 for s in shards)
    assert len(set().union(*items)) == sum(len(s) for s in items)  # pairwise disjoint
    assert [shards[1][i] for i in range(5)] == [partition_dataset(data, 1, 4, seed=7)[i] for i in range(5)]
    assert DataPartitioner(data, [0.5, 0.5], seed=1).partitions != DataPartitioner(data, [0.5, 0.5], seed=2).partitions


@pytest.mark.fast
def test_report_files(tmp_path):
    rows = [BenchRow(op, size, 2, "gloo", "float32", 2, 10.0 * size / 1024, 1.0, busbw_factor(op, 2))
            for op in ("all_reduce", "ring_all_reduce", "memcpy") for size in (1024, 4096)]
    paths = save_benchmark(rows, tmp_path, meta={"note": "fake"})
    assert paths["png"].read_bytes()[:8] == PNG_MAGIC
    assert len(json.loads(paths["json"].read_text())["rows"]) == 6
    assert paths["csv"].read_text().splitlines()[0].startswith("op,size_bytes")


class _StubTrainer:
    """The few Trainer attributes the callback reads."""

    def __init__(self, rank: int, world_size: int, out_dir: str) -> None:
        self.loggers, self.current_epoch, self.global_step = [], 0, 0
        self.world_size, self.is_global_zero = world_size, rank == 0
        self.log_dir = self.default_root_dir = out_dir


@pytest.mark.fast
def test_callback_without_process_group_says_so_once(tmp_path, caplog):
    cb = CollectivesCheck(at=["setup", "fit_start"], every_n_epochs=1)
    cb = pickle.loads(pickle.dumps(cb))  # ddp_spawn pickles callbacks
    with caplog.at_level(logging.INFO):
        assert cb.run(_StubTrainer(0, 1, str(tmp_path)), "setup") is None
        assert cb.run(_StubTrainer(0, 1, str(tmp_path)), "fit_start") is None
    assert sum("nothing to check" in r.getMessage() for r in caplog.records) == 1
    assert not list(tmp_path.iterdir())
    with pytest.raises(ConfigError, match="trigger"):
        CollectivesCheck(at="epoch_start")


@pytest.mark.fast
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"nproc": 0}, "nproc=0"),
        ({"mode": "nope"}, "mode=nope"),
        ({"mode": "blocking", "nproc": 1}, "set nproc=2 or more"),
        ({"backend": "mpi"}, "backend=mpi"),
        ({"backend": "tpu"}, "backend=tpu"),
        ({"init_method": "tcp://127.0.0.1"}, "has no host or no port"),
        ({"init_method": "udp://x:1"}, "is not one of the forms; fix: use env://"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"mode": "bench", "bench": {"sizes": ["1XB"]}}, "bench.sizes"),
        ({"mode": "bench", "bench": {"ops": ["all_reduce", "nope"]}}, "bench.ops"),
        ({"check": {"ops": ["nope"]}}, "check.ops"),
    ],
)
def test_bad_config_is_refused_before_spawning(overrides, message, monkeypatch, tmp_path):
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        monkeypatch.delenv(var, raising=False)
    cfg = {"mode": "check", "nproc": 2, "backend": "gloo", "init_method": "env://", "timeout_s": 10, **overrides}
    if overrides.get("backend") == "mpi" and dist.is_mpi_available():
        pytest.skip("this torch has MPI")
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        plan_from_config(cfg, tmp_path)


@pytest.mark.fast
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_nccl_without_gpu_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="backend=nccl needs a CUDA GPU"):
        plan_from_config({"mode": "check", "nproc": 2, "backend": "nccl", "init_method": "env://",
                          "timeout_s": 10}, tmp_path)


# ====================================================================== multi-process (slow)

@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def many(request, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp(f"collectives{request.param}")
    results = run_workers(workers.many_checks, request.param, str(out_dir), timeout=240)
    return request.param, out_dir, results


@pytest.mark.slow
def test_every_check_passes_and_ran(many):
    n, _, results = many
    for per_rank in results:
        ran = {op for op, _, _ in per_rank["results"]}
        assert ran == set(CHECK_NAMES)  # the expected set of ops actually ran
        for op, status, reason in per_rank["results"]:
            assert status == PASSED or (status == SKIPPED and "unsupported by" in reason), (op, status, reason)
        assert per_rank["warnings"] == []  # no deprecated tensor-form collectives


@pytest.mark.slow
def test_ring_all_reduce_equals_builtin(many):
    n, _, results = many
    for per_rank in results:
        cases = per_rank["ring"]
        assert {c["numel"] for c in cases} >= {0, 1, n - 1, 7, 1000, 2**20 + 3}
        assert {"float32", "float64", "int64"} <= {c["dtype"] for c in cases}
        assert all(c["equal"] for c in cases), [c for c in cases if not c["equal"]]


@pytest.mark.slow
def test_sync_sgd_matches_ddp(many):
    _, _, results = many
    for per_rank in results:
        assert per_rank["sgd"]["max_grad_diff"] <= 1e-6
        assert per_rank["sgd"]["max_param_diff"] <= 1e-6


def _assert_names_faulty_op(msg: str, n: int) -> None:
    expected = n * (n + 1) / 2
    assert "all_reduce.faulty" in msg and f"ranks [{n - 1}]" in msg
    assert f"expected [{expected:g}" in msg and f"received [{expected + 1:g}" in msg


@pytest.mark.slow
def test_wrong_reduction_is_reported(many):
    n, _, results = many
    for per_rank in results:
        _assert_names_faulty_op(per_rank["faulty_message"], n)


@pytest.mark.slow
def test_hung_collective_times_out_with_its_name(many):
    _, _, results = many
    assert "all_reduce.missing_rank" in results[0]["timeout_message"]
    # timeout_s=1: it fired, well before the missing rank (asleep for 8 s) could have ended the wait by exiting;
    # the slack is for a loaded machine, as this suite runs two test files at a time
    assert results[0]["timeout_seconds"] < 5


@pytest.mark.slow
def test_small_benchmark_writes_outputs(many):
    _, out_dir, results = many
    assert results[0]["bench_skipped"] == {}
    rows = json.loads((out_dir / "collectives_bench.json").read_text())["rows"]
    assert {r["op"] for r in rows} >= {"all_reduce", "ring_all_reduce", "all_gather", "reduce_scatter",
                                        "all_to_all", "broadcast", "reduce", "memcpy"}
    assert len({r["size_bytes"] for r in rows}) == 2
    assert all(r["busbw_GBps"] > 0 and r["latency_us"] > 0 for r in rows)
    assert (out_dir / "collectives_bench.png").read_bytes()[:8] == PNG_MAGIC
    assert len((out_dir / "collectives_bench.csv").read_text().splitlines()) == len(rows) + 1


class _TinyModule(L.LightningModule):
    """Just enough model for a fit: the callback needs nothing from it."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(16, 4, generator=gen), torch.randn(16, 1, generator=gen)),
                          batch_size=4)


@pytest.mark.slow
def test_callback_in_a_two_process_ddp_spawn_fit(tmp_path):
    """Runs at setup, fit start and epoch end on the trainer's own group; logs, writes its JSON; the extra
    check goes wrong on its third run (epoch end), which must stop the fit with a message naming it."""
    cb = CollectivesCheck(at=["setup", "fit_start"], every_n_epochs=1, benchmark=True, bench_sizes=["4KB"],
                          bench_warmup=1, bench_iters=2,
                          extra_checks=[Check("all_reduce.faulty", workers.faulty_from_third_run)])
    # The project's DDPStrategy is Lightning's plus a group destroyed at exit, so no rank aborts at shutdown.
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(start_method="spawn"), max_steps=2,
                        callbacks=[cb],
                        logger=CSVLogger(tmp_path), enable_progress_bar=False, enable_checkpointing=False,
                        enable_model_summary=False, default_root_dir=tmp_path)
    with pytest.raises(Exception, match="all_reduce.faulty") as failure:  # re-raised from the spawned rank
        trainer.fit(_TinyModule())
    _assert_names_faulty_op(str(failure.value), 2)
    log_dir = tmp_path / "lightning_logs" / "version_0"
    runs = json.loads((log_dir / "collectives.json").read_text())["runs"]
    assert [r["trigger"] for r in runs] == ["setup:fit", "fit_start", "epoch_end:0"]
    assert [r["checks"]["counts"]["failed"] for r in runs] == [0, 0, 1]
    assert "error" not in runs[1] and "all_reduce.faulty" in runs[2]["error"]
    assert runs[1]["checks"]["world_size"] == 2 and runs[1]["metrics"]["comm/all_reduce/busbw_GBps"] > 0
    header = (log_dir / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"comm/check/passed", "comm/check/failed", "comm/all_reduce/busbw_GBps",
            "comm/ring_all_reduce/busbw_GBps"} <= set(header)


def _run_cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``python -m src.engine.collectives ARGS`` from the repository root, as the README runs it."""
    return subprocess.run([sys.executable, "-m", "src.engine.collectives", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=180)


@pytest.mark.slow
def test_entry_point_check_mode(tmp_path):
    """The docs' `python -m src.engine.collectives mode=check nproc=3` on gloo: it exits 0 and no check failed. It is
    this test that runs that docs command (tests/test_readme_commands.py)."""
    args = shlex.split(docs_command("python -m src.engine.collectives mode=check nproc="))[3:]
    nproc = int(dict(arg.split("=", 1) for arg in args)["nproc"])
    proc = _run_cli(*args, "backend=gloo", f"hydra.run.dir={tmp_path}")  # CPU, any machine
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert_no_error_line(proc.stderr)
    saved = json.loads((tmp_path / "collectives_check.json").read_text())
    assert saved["counts"]["failed"] == 0 and saved["world_size"] == nproc >= 2


@pytest.mark.slow
def test_entry_point_bad_option_is_one_line(tmp_path):
    proc = _run_cli("nproc=0", f"hydra.run.dir={tmp_path}")
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines == ["error: nproc=0 is not an integer >= 1; fix: set nproc=1 or more"]


# ====================================================================== GPU (skipped without CUDA)

@pytest.mark.gpu
@pytest.mark.slow
@requires_nccl
@requires_2_gpus
def test_suite_on_nccl():
    for per_rank in run_workers(workers.nccl_suite, 2, find_free_network_port()):
        assert ("ring", "True", "") in per_rank
        assert all(status != FAILED for _, status, _ in per_rank), per_rank


@pytest.mark.fast
def test_auto_backend_needs_a_gpu_per_spawned_rank(monkeypatch):
    """On a 1-GPU machine, `nproc=2` with backend=auto is gloo: two nccl ranks on one GPU are invalid (seen on an H100)."""
    from src.engine.collectives.launch import resolve_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    assert resolve_backend("auto", 1, spawning=True) == "nccl"
    assert resolve_backend("auto", 2, spawning=True) == "gloo"
    assert resolve_backend("auto", 2, spawning=False) == "nccl"  # torchrun/SLURM placed the ranks
    with pytest.raises(ConfigError, match="nproc=2 needs 2 GPUs"):
        resolve_backend("nccl", 2, spawning=True)


_WITHOUT_LIGHTNING = """
import logging, sys
import src.engine.collectives.__main__  # the entry's imports, and the job-logging filter Hydra builds for it
from src.engine.utils.pylogger import RankFilter
record = logging.LogRecord("x", logging.INFO, "x.py", 0, "m", None, None)
RankFilter().filter(record)
lightning = sorted(m for m in sys.modules if m.split(".")[0] == "lightning")
print(len(lightning), record.rank, *lightning[:3])
"""


@pytest.mark.fast
def test_the_entry_starts_without_lightning_and_logs_its_launchers_rank():
    """``python -m src.engine.collectives`` needs torch only: Lightning's imports (seconds per process) stay out,
    and a log line still carries the rank its launcher set (here ``RANK=3``)."""
    proc = subprocess.run([sys.executable, "-c", _WITHOUT_LIGHTNING], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "RANK": "3"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["0", "3"], proc.stdout  # modules of Lightning imported, the record's rank
