"""Named suites: ``--suite throughput,startup,accuracy,ddp,pipeline,collectives``.

Each module has ``run(bench) -> SuiteResult``; a new comparison plugs in by adding a module and a
line here.
"""

from __future__ import annotations

import importlib

NAMES = ("throughput", "startup", "accuracy", "ddp", "pipeline", "collectives")


def load(name: str):
    """The ``run`` function of suite ``name``."""
    return importlib.import_module(f"scripts.bench.suites.{name}").run
