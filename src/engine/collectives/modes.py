"""What each ``mode=`` of ``python -m src.engine.collectives`` does on every rank (rank 0 prints and writes files)."""

from __future__ import annotations

import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from src.engine.collectives.benchmark import (
    DEFAULT_OPS,
    benchmark_sweep,
    busbw_factor,
    format_size,
    parse_size,
    ring_ratio,
    size_sweep,
)
from src.engine.collectives.checks import select_checks
from src.engine.collectives.demos import DEMOS, gather_lines
from src.engine.collectives.report import (
    bench_table,
    check_table,
    print_table,
    save_benchmark,
    write_json,
)
from src.engine.collectives.ring import compare_with_all_reduce
from src.engine.collectives.runtime import CollectiveError, comm_device
from src.engine.collectives.suite import ALL_CHECKS, run_suite
from src.engine.collectives.sync_sgd import compare_with_ddp, train_sync_sgd

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32}


# ---------------------------------------------------------------- validation (parent process, before spawning)

def _positive_int(section: str, key: str, value: Any, minimum: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{section}.{key}={value} must be an integer >= {minimum}")
    return value


def _dtype(section: str, name: Any) -> str:
    if name not in DTYPES:
        raise ValueError(f"{section}.dtype={name} is unknown; use one of {', '.join(DTYPES)}")
    return str(name)


def _bench_options(b: dict) -> dict:
    try:
        sizes = [parse_size(s) for s in b["sizes"]] if b.get("sizes") else size_sweep(
            b.get("min_size", "1KB"), b.get("max_size", "64MB"), b.get("factor", 4))
    except ValueError as err:
        raise ValueError(f"bench.sizes/min_size/max_size/factor: {err}") from None
    ops = list(b.get("ops") or DEFAULT_OPS)
    for op in ops:
        try:
            busbw_factor(op, 2)
        except ValueError:
            raise ValueError(f"bench.ops: {op!r} is unknown; use some of {', '.join(DEFAULT_OPS)}") from None
    return {"sizes": sizes, "ops": ops, "warmup": _positive_int("bench", "warmup", b.get("warmup", 5), 0),
            "iters": _positive_int("bench", "iters", b.get("iters", 20)), "memcpy": bool(b.get("memcpy", True)),
            "dtype": _dtype("bench", b.get("dtype", "float32"))}


def _ring_options(r: dict) -> dict:
    numels = [_positive_int("ring", "numels", int(x) if str(x).isdigit() else x, 0) for x in r.get("numels", [])]
    return {"numels": numels, "dtypes": [_dtype("ring", d) for d in r.get("dtypes", ["float32"])],
            "bench_sizes": [parse_size(s) for s in r.get("bench_sizes", [])],
            "warmup": _positive_int("ring", "warmup", r.get("warmup", 3), 0),
            "iters": _positive_int("ring", "iters", r.get("iters", 10))}


def _sgd_options(s: dict) -> dict:
    lr, tol = s.get("lr", 0.1), s.get("tolerance", 1e-6)
    if not isinstance(lr, int | float) or lr <= 0 or not isinstance(tol, int | float) or tol < 0:
        raise ValueError(f"sgd.lr={lr} must be > 0 and sgd.tolerance={tol} >= 0")
    return {"steps": _positive_int("sgd", "steps", s.get("steps", 5)),
            "epochs": _positive_int("sgd", "epochs", s.get("epochs", 3)),
            "batch_size": _positive_int("sgd", "batch_size", s.get("batch_size", 16)),
            "lr": float(lr), "tolerance": float(tol), "seed": int(s.get("seed", 0))}


def validate_options(mode: str, conf: dict) -> dict:
    """The validated options of ``mode`` (plain data); ValueError names the bad key and the fix."""
    if mode == "check":
        ops = (conf.get("check") or {}).get("ops")
        try:
            select_checks(ALL_CHECKS, ops)
        except ValueError as err:
            raise ValueError(f"check.ops: {err}") from None
        return {"ops": list(ops) if ops else None}
    if mode == "bench":
        return _bench_options(conf.get("bench") or {})
    if mode == "ring":
        return _ring_options(conf.get("ring") or {})
    if mode == "sgd":
        return _sgd_options(conf.get("sgd") or {})
    return {}


# ---------------------------------------------------------------- runners (every rank)

def _say(text: str) -> None:
    Console(soft_wrap=True, highlight=False).print(text)


def _is_rank0() -> bool:
    return dist.get_rank() == 0


def _meta(plan: Any) -> dict[str, Any]:
    return {"mode": plan.mode, "backend": plan.backend, "world_size": dist.get_world_size(),
            "torch": torch.__version__, "host": platform.node(), "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "options": plan.options}


def run_demo(plan: Any) -> None:
    lines = gather_lines(DEMOS[plan.mode]())
    if lines is not None:
        for line in lines:
            _say(line)
    verdict = [any("WRONG" in ln for ln in lines)] if lines is not None else [False]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0]:
        raise CollectiveError(f"mode={plan.mode}: a rank received the wrong values (see the lines above)")


def run_check(plan: Any) -> None:
    report = run_suite(only=plan.options.get("ops"), timeout_s=plan.timeout_s)
    if _is_rank0():
        print_table(check_table(report))
        path = write_json(Path(plan.out_dir) / "collectives_check.json", {"meta": _meta(plan), **report.to_dict()})
        _say(f"wrote {path}")
    report.raise_if_failed()


def run_bench(plan: Any) -> None:
    o = plan.options
    rows, skipped = benchmark_sweep(o["sizes"], o["ops"], o["warmup"], o["iters"], DTYPES[o["dtype"]], o["memcpy"])
    if _is_rank0():
        print_table(bench_table(rows, skipped))
        paths = save_benchmark(rows, plan.out_dir, skipped, _meta(plan))
        _say_ring_ratios("ring/built-in all_reduce busbw", ring_ratio(rows))
        _say("wrote " + ", ".join(str(p) for p in paths.values()))


def _say_ring_ratios(label: str, ratios: dict) -> None:
    if ratios:
        _say(f"{label}: " + ", ".join(f"{format_size(s)} {r:.2f}x" for s, r in sorted(ratios.items())))


def run_ring(plan: Any) -> None:
    o = plan.options
    cases = compare_with_all_reduce(o["numels"], [DTYPES[d] for d in o["dtypes"]], device=comm_device())
    rows, skipped = benchmark_sweep(o["bench_sizes"], ("all_reduce", "ring_all_reduce"), o["warmup"],
                                    o["iters"]) if o["bench_sizes"] else ([], {})
    bad = [c for c in cases if not c["equal"]]
    if _is_rank0():
        table = Table(title=f"ring_all_reduce vs dist.all_reduce - {plan.backend}, {dist.get_world_size()} ranks")
        for col in ("numel", "dtype", "equal", "max |diff|"):
            table.add_column(col)
        for c in cases:
            table.add_row(str(c["numel"]), c["dtype"], "[green]yes[/]" if c["equal"] else "[bold red]NO[/]",
                          f"{c['max_abs_diff']:g}")
        print_table(table)
        if rows:
            print_table(bench_table(rows, skipped))
            _say_ring_ratios("ring/built-in busbw", ring_ratio(rows, 0))
        write_json(Path(plan.out_dir) / "collectives_ring.json",
                   {"meta": _meta(plan), "cases": cases, "rows": [r.as_dict() for r in rows]})
    if bad:
        raise CollectiveError("ring_all_reduce differs from dist.all_reduce for "
                              + ", ".join(f"numel={c['numel']} {c['dtype']} (max |diff| {c['max_abs_diff']:g})"
                                          for c in bad))


def run_sgd(plan: Any) -> None:
    o = plan.options
    diffs = compare_with_ddp(steps=o["steps"], batch_size=o["batch_size"], lr=o["lr"], seed=o["seed"])
    losses = train_sync_sgd(epochs=o["epochs"], batch_size=o["batch_size"], lr=o["lr"], seed=o["seed"])
    if _is_rank0():
        _say(f"hand-written sync SGD vs DDP over {o['steps']} steps: max |grad diff| "
                        f"{diffs['max_grad_diff']:.2e}, max |weight diff| {diffs['max_param_diff']:.2e} "
                        f"(tolerance {o['tolerance']:g})")
        _say("sync SGD loss per epoch: " + ", ".join(f"{x:.4f}" for x in losses))
        write_json(Path(plan.out_dir) / "collectives_sgd.json", {"meta": _meta(plan), **diffs, "losses": losses})
    if max(diffs["max_grad_diff"], diffs["max_param_diff"]) > o["tolerance"]:
        raise CollectiveError(f"sync SGD: gradients differ from DDP's by {diffs['max_grad_diff']:.3e} "
                              f"(> tolerance {o['tolerance']:g})")


RUNNERS: dict[str, Callable[[Any], None]] = {
    "blocking": run_demo, "non_blocking": run_demo, "all_reduce": run_demo,
    "check": run_check, "bench": run_bench, "ring": run_ring, "sgd": run_sgd,
}


def run_mode(plan: Any) -> None:
    """Run ``plan.mode`` on this rank (the process group is already initialised)."""
    RUNNERS[plan.mode](plan)
