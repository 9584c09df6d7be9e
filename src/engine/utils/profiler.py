"""The Trainer's profiler when nothing is profiled: Lightning's ``PassThroughProfiler`` at a lower cost.

Lightning wraps every hook it calls (each callback's, the module's, the strategy's: many a training step) in
``trainer.profiler.profile(name)``. Its pass-through profiler builds a generator-based context manager for
each; this one hands back one shared no-op context. Measured side by side in docs/benchmarks.md. ``trainer.profiler=simple`` (or ``debug=profiler``) profiles as usual.
"""

from __future__ import annotations

import contextlib

from lightning.pytorch.profilers import PassThroughProfiler

_NOTHING = contextlib.nullcontext()


class NoProfiler(PassThroughProfiler):
    """Profiles nothing; ``profile()`` returns a shared no-op context (re-entrant, so nesting is fine)."""

    def profile(self, action_name: str) -> contextlib.nullcontext:  # type: ignore[override]
        return _NOTHING
