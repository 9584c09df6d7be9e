"""Pipeline parallelism: runs ``scripts/bench_pipeline.py``'s ``run(...)`` when that script exists."""

from __future__ import annotations

import importlib
import inspect

from scripts.bench.contenders import ROOT
from scripts.bench.context import Bench, SuiteResult

SCRIPT = ROOT / "scripts" / "bench_pipeline.py"
QUICK = {"steps": 3, "warmup": 1, "rounds": 2, "micro_batches": (1, 4)}


def run(bench: Bench) -> SuiteResult:
    result = SuiteResult("pipeline", "Pipeline parallelism (scripts/bench_pipeline.py)")
    module = _load()
    if module is None or not hasattr(module, "run"):
        result.notes.append("not available: scripts/bench_pipeline.py with a run(...) function is missing")
        return result
    defaults = getattr(module, "DEFAULTS", {})
    overrides = {} if bench.settings.full else {k: v for k, v in QUICK.items() if k in defaults}
    accepts_out = "out" in inspect.signature(module.run).parameters
    out_dir = bench.out / "pipeline"
    data = module.run(out=str(out_dir), **overrides) if accepts_out else module.run(**overrides)
    result.raw = data if isinstance(data, dict) else {"result": data}
    if hasattr(module, "markdown"):
        result.markdown = module.markdown(data)
    result.notes.append(f"scripts/bench_pipeline.run({', '.join(f'{k}={v!r}' for k, v in overrides.items())}); "
                        f"its own files are in {out_dir.name}/.")
    return result


def _load():
    """Import it by its package path, so the processes it spawns can import its workers too."""
    return importlib.import_module("scripts.bench_pipeline") if SCRIPT.exists() else None
