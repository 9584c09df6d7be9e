"""Worker functions for ``tests/test_collectives*.py``, run on gloo ranks by ``run_workers``, and
:class:`DeviceOnlyGroup`, which makes a gloo group as strict as nccl about where tensors live.

Both test files share them, and no tests are collected from here.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from src.engine.collectives.benchmark import benchmark_sweep
from src.engine.collectives.checks import Check, run_checks
from src.engine.collectives.report import save_benchmark
from src.engine.collectives.ring import compare_with_all_reduce, ring_all_reduce
from src.engine.collectives.runtime import CollectiveError, CollectiveTimeoutError
from src.engine.collectives.suite import run_suite
from src.engine.collectives.sync_sgd import compare_with_ddp

ROOT = Path(__file__).resolve().parents[2]


def faulty_all_reduce(ctx):
    """An injected faulty op: the last rank corrupts its all_reduce result."""
    t = torch.full((3,), float(ctx.rank + 1), device=ctx.device)
    ctx.wait(dist.all_reduce(t, async_op=True))
    if ctx.rank == ctx.world_size - 1:
        t += 1
    n = ctx.world_size
    return torch.full((3,), n * (n + 1) / 2), t


_RUNS = itertools.count()


def faulty_from_third_run(ctx):
    """Correct on its first two runs in a process, then the last rank corrupts its all_reduce result."""
    return faulty_all_reduce(ctx) if next(_RUNS) >= 2 else _honest_all_reduce(ctx)


def _honest_all_reduce(ctx):
    t = torch.full((3,), float(ctx.rank + 1), device=ctx.device)
    ctx.wait(dist.all_reduce(t, async_op=True))
    n = ctx.world_size
    return torch.full((3,), n * (n + 1) / 2), t


def ring_cases(n: int) -> list[dict]:
    numels = [0, 1, n - 1, 7, 1000, 2**20 + 3]
    rows = compare_with_all_reduce(numels)
    for op in (dist.ReduceOp.MAX, dist.ReduceOp.MIN):
        rows += [{**r, "op": str(op)} for r in compare_with_all_reduce([0, 5, 1000], op=op)]
    # the stepwise schedule, tiny segments (many per chunk), and a non-contiguous input
    x = torch.arange(3000, dtype=torch.float64).reshape(60, 50).t() * (dist.get_rank() + 1)
    y = x.clone()
    ring_all_reduce(x, segment_bytes=64)
    dist.all_reduce(y)
    z = torch.arange(1001, dtype=torch.int64) * (dist.get_rank() + 1)
    zz = z.clone()
    ring_all_reduce(z, pipelined=False)
    dist.all_reduce(zz)
    rows.append({"numel": 3000, "dtype": "non-contiguous/segments", "equal": torch.equal(x, y)})
    rows.append({"numel": 1001, "dtype": "stepwise", "equal": torch.equal(z, zz)})
    return rows


def many_checks(rank: int, world_size: int, out_dir: str) -> dict:
    """One start of the ranks, everything: suite, ring, sync SGD, a faulty op, a small benchmark, a timeout."""
    out: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = run_suite(timeout_s=30)
    out["results"] = [(r.op, r.status, r.reason) for r in report.results]
    out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning | FutureWarning)]
    out["ring"] = ring_cases(world_size)
    out["sgd"] = compare_with_ddp(steps=3, batch_size=8)

    faulty = Check("all_reduce.faulty", faulty_all_reduce)
    bad = run_checks(checks=[], extra_checks=[faulty], timeout_s=30)
    try:
        bad.raise_if_failed()
    except CollectiveError as err:
        out["faulty_message"] = str(err)

    rows, skipped = benchmark_sweep(["4KB", "64KB"], warmup=1, iters=2)
    out["bench_skipped"] = skipped
    if rank == 0:
        save_benchmark(rows, out_dir, skipped)

    # last, as it leaves the group unusable: rank 0 waits for an all_reduce that rank 1 never joins
    timeout_check = Check("all_reduce.missing_rank", all_reduce_without_last_rank)
    start = time.monotonic()
    try:
        run_checks(checks=[], extra_checks=[timeout_check], timeout_s=1.0, gather=False)
    except CollectiveTimeoutError as err:
        out["timeout_message"] = str(err)
    out["timeout_seconds"] = time.monotonic() - start
    time.sleep(3)  # no rank leaves (closing its connections) while another still waits for its own timeout
    return out


def all_reduce_without_last_rank(ctx):
    if ctx.rank == ctx.world_size - 1:
        time.sleep(8)  # stay alive (also on a loaded machine) so the others see a timeout, not a closed connection
        return None
    t = torch.ones(2)
    ctx.wait(dist.all_reduce(t, async_op=True))
    return t, t


def nccl_suite(rank: int, world_size: int, port: int) -> list[tuple[str, str, str]]:
    """Swap the helper's gloo group for an nccl one (tensors on cuda:rank) and run the suite."""
    torch.cuda.set_device(rank)
    dist.destroy_process_group()
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    report = run_suite(timeout_s=60)
    x = torch.arange(1 << 20, dtype=torch.float32, device=f"cuda:{rank}") * (rank + 1)
    y = x.clone()
    ring_all_reduce(x)
    dist.all_reduce(y)
    return [(r.op, r.status, r.reason) for r in report.results] + [("ring", str(torch.equal(x, y)), "")]


# ====================================================================== a group that takes device tensors only

FAKE_DEVICE = torch.device("cpu", 1)
"""Stands for the GPU of an nccl group: CPU kernels accept the index, so code runs unchanged on gloo, and
every call that names this device can be seen."""

_TENSOR_COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
                       "all_gather_single", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
                       "all_to_all", "all_to_all_single", "scatter", "gather", "send", "recv", "isend", "irecv")
_P2P = {"send": "send", "isend": "send", "recv": "recv", "irecv": "recv"}


class _MarkNamed(TorchFunctionMode):
    """Tensors made by a call that names FAKE_DEVICE (``zeros(device=)``, ``tensor(device=)``, ``.to()``)."""

    def __init__(self, owner: DeviceOnlyGroup) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if any(isinstance(a, torch.device) and a == FAKE_DEVICE for a in (*args, *kwargs.values())):
            self.owner.mark(out)
        return out


class _Spread(TorchDispatchMode):
    """Results computed from device tensors are device tensors (autograd's backward ops included), as on a
    GPU; an explicit ``device=`` (``.cpu()``) and in-place writes keep the target's placement."""

    def __init__(self, owner: DeviceOnlyGroup) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not func._schema.is_mutable and kwargs.get("device") is None and any(
                self.owner.on_device(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)):
            self.owner.mark(out)
        return out


class DeviceOnlyGroup:
    """Make the gloo world group take, like nccl, tensors on its device only: ``comm_device()`` says
    FAKE_DEVICE, tensors made there or computed from such tensors are "device" tensors (tracked by storage),
    and every tensor collective records each host tensor it is handed (then runs as usual).

    It also logs the order of point-to-point calls (``p2p``), with batches as ``("batch", [...])``.
    Empty tensors move no data and are not judged. Device storages are kept alive for the whole run, so a
    freed address cannot pass a later host tensor off as a device one.
    """

    def __init__(self) -> None:
        self.storages: dict[int, Any] = {}
        self.violations: list[str] = []
        self.callers: set[str] = set()
        self.p2p: list[Any] = []
        self._batch: list | None = None
        self._undo: list[tuple[Any, str, Any]] = []
        self._local = threading.local()
        self._modes = (_MarkNamed(self), _Spread(self))

    # -- placement
    def mark(self, out: Any) -> None:
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel():
                self.storages[t.untyped_storage().data_ptr()] = t.untyped_storage()

    def on_device(self, t: torch.Tensor) -> bool:
        return t.numel() > 0 and t.untyped_storage().data_ptr() in self.storages

    # -- the collectives
    def _wrap(self, name: str, original: Callable) -> Callable:
        def collective(*args, **kwargs):
            if getattr(self._local, "inside", False):  # torch re-enters through __torch_function__
                return original(*args, **kwargs)
            self._local.inside = True
            try:
                self._judge(name, args, kwargs)
                return original(*args, **kwargs)
            finally:
                self._local.inside = False

        return collective

    def _judge(self, name: str, args: tuple, kwargs: dict) -> None:
        where = _caller()
        self.callers.add(where.split(":")[0])
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and t.numel() and not self.on_device(t):
                self.violations.append(f"{name} got a host tensor {tuple(t.shape)} {t.dtype} at {where}")
        if name in _P2P:
            peer = kwargs.get("dst", kwargs.get("group_dst", kwargs.get("src", kwargs.get("group_src"))))
            entry = (_P2P[name], args[1] if peer is None else peer)
            (self._batch if self._batch is not None else self.p2p).append(entry)

    def _batched(self, original: Callable) -> Callable:
        def batch_isend_irecv(ops):
            self._batch = []
            try:
                return original(ops)
            finally:
                self.p2p.append(("batch", self._batch))
                self._batch = None

        return batch_isend_irecv

    def _patch(self, obj: Any, name: str, value: Any) -> None:
        self._undo.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def __enter__(self) -> DeviceOnlyGroup:
        from src.engine.collectives import runtime

        swaps = {id(runtime.comm_device): lambda group=None: FAKE_DEVICE,
                 id(dist.batch_isend_irecv): self._batched(dist.batch_isend_irecv)}
        for name in _TENSOR_COLLECTIVES:
            if hasattr(dist, name):
                swaps[id(getattr(dist, name))] = self._wrap(name, getattr(dist, name))
        # torch.distributed, c10d's isend/irecv (P2POp checks ``op`` against them), every alias in the package
        for module in [dist, c10d, *(m for n, m in list(sys.modules.items()) if n.startswith("src.engine.collectives"))]:
            for attr, value in list(vars(module).items()):
                if id(value) in swaps and (module is not c10d or attr in ("isend", "irecv")):
                    self._patch(module, attr, swaps[id(value)])
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        for obj, name, value in reversed(self._undo):
            setattr(obj, name, value)


def _caller() -> str:
    """``path:line`` of the innermost frame outside torch and this helper: the call site under test."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if frame.filename != __file__ and "/torch/" not in frame.filename:
            path = Path(frame.filename)
            return f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{frame.lineno}"
    return "?"


class _StubTrainer:
    """The few Trainer attributes the callback reads."""

    def __init__(self, rank: int, world_size: int, out_dir: str) -> None:
        self.loggers, self.current_epoch, self.global_step = [], 0, 0
        self.world_size, self.is_global_zero = world_size, rank == 0
        self.log_dir = self.default_root_dir = out_dir


DISCIPLINE_MODES = (
    ("check", {}),
    ("bench", {"bench": {"sizes": ["4KB"], "warmup": 1, "iters": 2}}),
    ("ring", {"ring": {"numels": [0, 5, 1000], "dtypes": ["float32", "int64"], "bench_sizes": ["4KB"],
                       "warmup": 1, "iters": 1}}),
    ("sgd", {"sgd": {"steps": 2, "epochs": 1, "batch_size": 8}}),
    ("blocking", {}), ("non_blocking", {}), ("all_reduce", {}),
)


def device_discipline(rank: int, world_size: int, out_dir: str) -> dict:
    """Every collective call site on the device-only group: each mode of ``python -m src.engine.collectives``,
    both ring schedules, and the callback (checks and benchmark); then a host tensor as a control."""
    from src.engine.collectives import runtime
    from src.engine.collectives.callback import CollectivesCheck
    from src.engine.collectives.launch import LaunchPlan
    from src.engine.collectives.modes import run_mode, validate_options

    with DeviceOnlyGroup() as fake:
        for mode, conf in DISCIPLINE_MODES:
            run_mode(LaunchPlan(mode, "gloo", world_size, "env://", 30.0, out_dir,
                                options=validate_options(mode, conf)))
        for pipelined in (True, False):
            ring_all_reduce(torch.arange(1000.0, device=runtime.comm_device()), pipelined=pipelined,
                            segment_bytes=256)
        callback = CollectivesCheck(benchmark=True, bench_sizes=["4KB"], bench_warmup=1, bench_iters=1)
        record = callback.run(_StubTrainer(rank, world_size, out_dir), "fit_start")
        found = len(fake.violations)
        dist.all_reduce(torch.zeros(2))  # control: a host tensor must be caught
    return {"violations": fake.violations[:found], "control": fake.violations[found:],
            "callers": sorted(fake.callers), "callback_bench_rows": len(record["benchmark"]["rows"])}


def p2p_orders(rank: int, world_size: int) -> dict[str, list]:
    """The order in which every point-to-point call site posts its sends and receives on this rank. The ring
    runs the schedule it picks on a backend that coalesces p2p calls (nccl)."""
    from src.engine.collectives import demos, ring
    from src.engine.collectives.suite import run_suite

    def ring_on_nccl(pipelined: bool) -> None:
        real = ring._supports_coalescing
        ring._supports_coalescing = lambda group, device: True
        try:
            x = torch.arange(1000.0) * (rank + 1)
            ring_all_reduce(x, pipelined=pipelined, segment_bytes=256)
            assert torch.equal(x, torch.arange(1000.0) * world_size * (world_size + 1) / 2)
        finally:
            ring._supports_coalescing = real

    sites = {
        "send_recv": lambda: run_suite(only=["send_recv"]).raise_if_failed(),
        "isend_irecv": lambda: run_suite(only=["isend_irecv"]).raise_if_failed(),
        "batch_isend_irecv": lambda: run_suite(only=["batch_isend_irecv"]).raise_if_failed(),
        "ring_pipelined": lambda: ring_on_nccl(True),
        "ring_stepwise": lambda: ring_on_nccl(False),
        "demo_blocking": demos.blocking_send_recv,
        "demo_non_blocking": demos.non_blocking_send_recv,
    }
    logs = {}
    for name, site in sites.items():
        with DeviceOnlyGroup() as fake:
            site()
        logs[name] = fake.p2p
    return logs


def nccl_p2p(rank: int, world_size: int, port: int) -> dict:
    """On an nccl group: the point-to-point checks, and the ring's three schedules against dist.all_reduce."""
    torch.cuda.set_device(rank)
    dist.destroy_process_group()
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    report = run_suite(only=["send_recv", "isend_irecv", "batch_isend_irecv"], timeout_s=30)
    ring = {}
    for name, kwargs in (("pipelined", {"pipelined": True, "segment_bytes": 64 << 10}),
                         ("stepwise", {"pipelined": False}), ("default", {})):
        x = torch.arange(1 << 20, dtype=torch.float32, device=f"cuda:{rank}") * (rank + 1)
        y = x.clone()
        ring_all_reduce(x, **kwargs)
        dist.all_reduce(y)
        ring[name] = torch.equal(x, y)
    return {"checks": [(r.op, r.status) for r in report.results], "ring": ring}
