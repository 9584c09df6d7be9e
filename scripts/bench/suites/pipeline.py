"""Pipeline parallelism: runs ``scripts/bench_pipeline.py``'s ``run(...)`` when that script exists."""

from __future__ import annotations

import importlib

from scripts.bench.contenders import ROOT
from scripts.bench.context import Bench, SuiteResult

SCRIPT = ROOT / "scripts" / "bench_pipeline.py"
QUICK = {"steps": 3, "warmup": 1, "rounds": 2, "micro_batches": (1, 4)}


def run(bench: Bench) -> SuiteResult:
    result = SuiteResult("pipeline", "Pipeline parallelism (scripts/bench_pipeline.py)")
    if not SCRIPT.exists():
        result.notes.append("not available: scripts/bench_pipeline.py is missing")
        return result
    # Imported by its package path, so the processes it spawns can import its workers too.
    module = importlib.import_module("scripts.bench_pipeline")
    overrides = {} if bench.settings.full else QUICK
    out_dir = bench.out / "pipeline"
    result.raw = module.run(out=str(out_dir), **overrides)
    result.markdown = module.markdown(result.raw)
    result.notes.append(f"scripts/bench_pipeline.run({', '.join(f'{k}={v!r}' for k, v in overrides.items())}); "
                        f"its own files are in {out_dir.name}/.")
    return result

