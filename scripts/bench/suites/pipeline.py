"""Pipeline parallelism: ``scripts/bench/pipeline_worker.py``'s ``run(...)``, GPipe and 1F1B side by side."""

from __future__ import annotations

from scripts.bench import pipeline_worker
from scripts.bench.context import Bench, SuiteResult

QUICK = {"steps": 3, "warmup": 1, "rounds": 2, "micro_batches": (1, 4)}


def run(bench: Bench) -> SuiteResult:
    result = SuiteResult("pipeline", "Pipeline parallelism (scripts/bench/pipeline_worker.py)")
    overrides = {} if bench.settings.full else QUICK
    out_dir = bench.out / "pipeline"
    result.raw = pipeline_worker.run(out=str(out_dir), **overrides)
    result.markdown = pipeline_worker.markdown(result.raw)
    result.notes.append(f"pipeline_worker.run({', '.join(f'{k}={v!r}' for k, v in overrides.items())}); "
                        f"its own files are in {out_dir.name}/.")
    return result
