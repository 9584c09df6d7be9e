"""Named suites: ``--suite throughput,startup,accuracy,ddp,pipeline,collectives,compile``.

Each module has ``run(bench) -> SuiteResult``; a new comparison plugs in by adding a module and a
line here.
"""

from __future__ import annotations

import importlib

NAMES = ("throughput", "startup", "accuracy", "ddp", "pipeline", "collectives", "compile")
DEFAULT = NAMES[:-1]  # compile takes minutes of inductor builds: ask for it with --suite compile


def load(name: str):
    """The ``run`` function of suite ``name``."""
    return importlib.import_module(f"scripts.bench.suites.{name}").run
