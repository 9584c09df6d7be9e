"""Present check and benchmark results: rich tables on the console, JSON/CSV files, a busbw plot."""

from __future__ import annotations

import csv
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from src.engine.collectives.benchmark import MEMCPY, BenchRow, format_size
from src.engine.collectives.checks import FAILED, PASSED, CheckReport

_STYLE = {PASSED: "green", FAILED: "bold red"}


def memcpy_label(device_type: str) -> str:
    """What the memcpy row measures: on a GPU a copy inside one GPU, not the link between GPUs."""
    return "device memcpy (intra-GPU, not a link)" if device_type == "cuda" else "memcpy (ceiling)"


def check_table(report: CheckReport) -> Table:
    """One row per check: status, ranks, expected vs received (or the skip reason)."""
    counts = report.counts()
    table = Table(title=f"collective checks - {report.backend}, {report.world_size} ranks: "
                        f"{counts[PASSED]} passed, {counts[FAILED]} failed, {counts['skipped']} skipped")
    for col in ("op", "status", "ranks", "expected", "received / reason"):
        table.add_column(col, overflow="fold")
    for r in report.results:
        style = _STYLE.get(r.status, "yellow")
        table.add_row(r.op, f"[{style}]{r.status}[/]", ",".join(map(str, r.failed_ranks or r.ranks)),
                      r.expected, r.received if r.status != "skipped" else r.reason)
    return table


def bench_table(rows: Sequence[BenchRow], skipped: Mapping[str, str] | None = None) -> Table:
    """One row per (op, size), grouped by size, with memcpy beside the ops (see :func:`memcpy_label`)."""
    head = rows[0] if rows else None
    title = f"collective bandwidth - {head.backend}, {head.world_size} ranks, {head.dtype}" if head else "no rows"
    table = Table(title=title, caption="; ".join(f"{op}: {why}" for op, why in (skipped or {}).items()) or None)
    for col in ("size", "op", "latency (us)", "algbw (GB/s)", "busbw (GB/s)"):
        table.add_column(col, justify="right" if col != "op" else "left")
    last_size = None
    for r in sorted(rows, key=lambda r: r.size_bytes):
        if last_size is not None and r.size_bytes != last_size:
            table.add_section()
        table.add_row(format_size(r.size_bytes) if r.size_bytes != last_size else "",
                      f"[dim]{memcpy_label(r.device)}[/]" if r.op == MEMCPY else r.op,
                      f"{r.latency_us:,.1f}", f"{r.algbw_GBps:.3f}", f"{r.busbw_GBps:.3f}")
        last_size = r.size_bytes
    return table


def print_table(table: Table) -> None:
    Console(width=140).print(table)


def write_json(path: str | Path, payload: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str))
    return path


def write_csv(path: str | Path, rows: Sequence[BenchRow]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = list(BenchRow.__dataclass_fields__)
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        writer.writerows(r.as_dict() for r in rows)
    return path


def plot_busbw(rows: Sequence[BenchRow], path: str | Path) -> Path:
    """busbw against message size (log x and y), one line per op; memcpy dashed (see :func:`memcpy_label`)."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never open a window (works on headless nodes)
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 5))
    for op in dict.fromkeys(r.op for r in rows):
        pts = sorted((r.size_bytes, r.busbw_GBps) for r in rows if r.op == op)
        style = {"linestyle": "--", "color": "black"} if op == MEMCPY else {"marker": "o"}
        if op == "ring_all_reduce":
            style = {"marker": "s", "linestyle": ":"}
        label = memcpy_label(next(r.device for r in rows if r.op == op)) if op == MEMCPY else op
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label, **style)
    ax.set_xscale("log", base=2)
    if all(r.busbw_GBps > 0 for r in rows):
        ax.set_yscale("log")  # the memcpy ceiling is often 10x the ops: keep both readable
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    if rows:
        ax.set_title(f"{rows[0].backend}, {rows[0].world_size} ranks, {rows[0].dtype}")
        sizes = sorted({r.size_bytes for r in rows})
        ax.set_xticks(sizes, [format_size(s) for s in sizes], rotation=45)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def save_benchmark(rows: Sequence[BenchRow], out_dir: str | Path, skipped: Mapping[str, str] | None = None,
                   meta: Mapping[str, Any] | None = None, stem: str = "collectives_bench") -> dict[str, Path]:
    """Write ``<stem>.json``, ``<stem>.csv`` and ``<stem>.png`` into ``out_dir``; return their paths."""
    out = Path(out_dir)
    payload = {"meta": dict(meta or {}), "skipped": dict(skipped or {}), "rows": [r.as_dict() for r in rows]}
    return {"json": write_json(out / f"{stem}.json", payload), "csv": write_csv(out / f"{stem}.csv", rows),
            "png": plot_busbw(rows, out / f"{stem}.png")}
