"""Collectives: runs ``python -m src.engine.collectives mode=bench`` (the collectives room's benchmark) when present."""

from __future__ import annotations

import json
import subprocess
import sys

from scripts.bench import contenders
from scripts.bench.contenders import ROOT
from scripts.bench.context import Bench, SuiteResult

ENTRY = ROOT / "src" / "engine" / "collectives" / "__main__.py"  # run as `python -m src.engine.collectives`
QUICK = ["bench.min_size=1KB", "bench.max_size=4MB", "bench.factor=16", "bench.iters=10", "bench.warmup=2"]


def run(bench: Bench) -> SuiteResult:
    result = SuiteResult("collectives", "Collectives (python -m src.engine.collectives mode=bench)")
    if not ENTRY.exists():
        result.notes.append(f"not available: {ENTRY} is missing")
        return result
    out_dir = bench.out / "collectives"
    n = bench.settings.nproc
    cmd = [sys.executable, "-m", "src.engine.collectives", "mode=bench", f"nproc={n}", f"hydra.run.dir={out_dir}",
           *([] if bench.settings.full else QUICK)]
    log = bench.out / "logs" / "collectives.log"
    with open(log, "wb") as fh:
        code = subprocess.run(cmd, cwd=ROOT, env=contenders.env(1), stdout=fh, stderr=subprocess.STDOUT).returncode
    print(f"  {'collectives':<28} exit {code}", flush=True)
    files = sorted(out_dir.glob("*.json"))
    if code != 0 or not files:
        result.notes.append(f"not available: `{' '.join(cmd[1:])}` exited {code} (log: logs/{log.name})")
        return result
    data = json.loads(files[0].read_text())
    rows = data.get("rows", [])
    result.raw = data
    if rows:
        largest = max(r["size_bytes"] for r in rows)
        result.columns = ["op", "size", "latency us", "busbw GB/s"]
        result.rows = [[_op(r), _size(r["size_bytes"]), f"{r['latency_us']:,.1f}", f"{r['busbw_GBps']:.2f}"]
                       for r in rows if r["size_bytes"] == largest]
    result.notes.append(f"{n} ranks; the largest message size shown; every size in {out_dir.name}/{files[0].name}.")
    result.plots += [f"{out_dir.name}/{png.name}" for png in sorted(out_dir.glob("*.png"))]
    return result


def _op(row: dict) -> str:
    """The op's name; the memcpy row says what it copied (on a GPU: inside one GPU, not over a link)."""
    from src.engine.collectives.report import memcpy_label

    return memcpy_label(row.get("device", "cpu")) if row["op"] == "memcpy" else row["op"]


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024:
            return f"{n:.0f} {unit}"
        n /= 1024
    return f"{n:.0f} TB"
