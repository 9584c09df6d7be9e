"""Check and measure torch.distributed communication: collectives suite, ring all-reduce, sync SGD, benchmark.

Everything works on the default process group of any backend (gloo on CPU, nccl with tensors on
``cuda:LOCAL_RANK``, mpi where built). Entry points: :func:`run_checks`, :func:`ring_all_reduce`,
:func:`average_gradients`, :func:`benchmark_sweep`, and the Lightning callback :class:`CollectivesCheck`.
"""

from src.distributed.collectives.benchmark import (
    BenchRow,
    benchmark_sweep,
    busbw_factor,
    parse_size,
    size_sweep,
)
from src.distributed.collectives.checks import Check, CheckContext, CheckReport, CheckResult, run_checks
from src.distributed.collectives.ring import compare_with_all_reduce, ring_all_reduce
from src.distributed.collectives.runtime import CollectiveError, CollectiveTimeoutError
from src.distributed.collectives.suite import ALL_CHECKS
from src.distributed.collectives.sync_sgd import (
    DataPartitioner,
    Partition,
    average_gradients,
    compare_with_ddp,
    partition_dataset,
)

__all__ = [
    "ALL_CHECKS", "BenchRow", "Check", "CheckContext", "CheckReport", "CheckResult", "CollectiveError",
    "CollectiveTimeoutError", "CollectivesCheck", "DataPartitioner", "Partition", "average_gradients",
    "benchmark_sweep", "busbw_factor", "compare_with_all_reduce", "compare_with_ddp", "parse_size",
    "partition_dataset", "ring_all_reduce", "run_checks", "size_sweep",
]


def __getattr__(name: str):
    # Lazy: the callback pulls in Lightning, which spawned ranks of `src/collectives.py` do not need.
    if name == "CollectivesCheck":
        from src.distributed.collectives.callback import CollectivesCheck

        return CollectivesCheck
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
