"""DataLoader workers outlive the stop signals their rank stops on.

A cluster's stop (SLURM's ``scancel``, a preemption, ``kill`` of a process group) signals every process of the
job, the DataLoader's workers too. torch's workers die on a SIGTERM from anyone but their parent, and their
rank then fails at its next batch ("DataLoader worker ... is killed by signal: Terminated") instead of making
the agreed stop, which waits for the validation or the epoch's end after its batch. So the workers ignore
the stop signals: the rank decides when to stop, and ends its workers as it always does.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


class IgnoreStopSignals:
    """A ``worker_init_fn`` that ignores the stop signals, then runs the loader's own (picklable for spawn)."""

    def __init__(self, inner: Callable[[int], Any] | None) -> None:
        self.inner = inner

    def __call__(self, worker_id: int) -> None:
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
        if self.inner is not None:
            self.inner(worker_id)


def workers_ignore_stop_signals(dataloader: Any) -> Any:
    """Give a DataLoader with workers the ``worker_init_fn`` above (once); anything else is returned as it is."""
    if isinstance(dataloader, DataLoader) and dataloader.num_workers > 0 \
            and not isinstance(dataloader.worker_init_fn, IgnoreStopSignals):
        dataloader.worker_init_fn = IgnoreStopSignals(dataloader.worker_init_fn)
    return dataloader


class WorkersOutliveStopSignals:
    """Strategy mixin: every loader Lightning hands the strategy (``process_dataloader``, before its iterator
    starts workers) gets workers that outlive the stop signals."""

    def process_dataloader(self, dataloader: object) -> object:
        return super().process_dataloader(workers_ignore_stop_signals(dataloader))  # type: ignore[misc]
