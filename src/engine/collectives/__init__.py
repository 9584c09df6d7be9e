"""Check and measure torch.distributed communication: collectives suite, ring all-reduce, sync SGD, benchmark.

Everything works on the default process group of any backend (gloo on CPU, nccl on this rank's GPU, mpi
where built); every tensor handed to a collective lives on :func:`comm_device`. Entry points:
:func:`run_suite`, :func:`ring_all_reduce`, :func:`average_gradients`, :func:`benchmark_sweep`, the
command line ``python -m src.engine.collectives``, and the one bridge to training, the Lightning callback
:class:`CollectivesCheck` (``callback.py``).
"""

from src.engine.collectives.benchmark import (
    BenchRow,
    benchmark_sweep,
    busbw_factor,
    parse_size,
    size_sweep,
)
from src.engine.collectives.checks import Check, CheckContext, CheckReport, CheckResult, run_checks
from src.engine.collectives.ring import compare_with_all_reduce, ring_all_reduce
from src.engine.collectives.runtime import CollectiveError, CollectiveTimeoutError, comm_device
from src.engine.collectives.suite import ALL_CHECKS, run_suite
from src.engine.collectives.sync_sgd import (
    DataPartitioner,
    Partition,
    average_gradients,
    compare_with_ddp,
    partition_dataset,
)

__all__ = [
    "ALL_CHECKS", "BenchRow", "Check", "CheckContext", "CheckReport", "CheckResult", "CollectiveError",
    "CollectiveTimeoutError", "CollectivesCheck", "comm_device", "DataPartitioner", "Partition", "average_gradients",
    "benchmark_sweep", "busbw_factor", "compare_with_all_reduce", "compare_with_ddp", "parse_size",
    "partition_dataset", "ring_all_reduce", "run_checks", "run_suite", "size_sweep",
]


def __getattr__(name: str):
    # Lazy: the callback pulls in Lightning, which spawned ranks of `python -m src.engine.collectives` do not need.
    if name == "CollectivesCheck":
        from src.engine.collectives.callback import CollectivesCheck

        return CollectivesCheck
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
