"""Per-process record of one training run: when each epoch started and ended and when each step ended.

Every contender (the project through :class:`scripts.bench.step_timer.StepTimer`, the plain scripts
directly) writes the same record, so the harness measures the same span for all of them. Stamps are
``time.perf_counter()`` except ``first_step_unix`` (``time.time()``), which the harness compares with
its own launch time to get the start-up cost. A whole epoch runs from its start to the next epoch's
start (the last one: to its ``end`` stamp), so it holds validation and the checkpoint save. Peak
memory is not recorded here: the harness takes it from the kernel (``wait4``, ``/proc``), which
also covers what happens after this file is written at interpreter exit.

On a GPU (``cuda=True``) the work a stamp closes may still be queued on the device, so the stamps that
bound a measured span (each epoch's start and end, its last step's end, the first step) wait for it with
``torch.cuda.synchronize()``; the other steps are stamped without waiting, so the host keeps running
ahead of the device as it does in an unmeasured run.

With ``BENCH_PROFILE_STEPS=N`` set, N steps of the second epoch are profiled
(:mod:`scripts.bench.step_profile`) and the summary goes into the record as ``profile``. Profiled runs
are not timed: the profiler slows the steps it watches.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import time
from pathlib import Path

from scripts.bench.step_profile import SKIP_STEPS, StepProfiler, profile_steps


class Timeline:
    """Collects epoch starts and ends and step ends; ``dump`` (also run at exit) writes them as JSON to ``path``."""

    def __init__(self, path: str | os.PathLike, rank: int = 0, cuda: bool = False) -> None:
        self.path = Path(path)
        self.rank = rank
        self.cuda = cuda
        self.epochs: list[dict] = []
        self.first_step_unix: float | None = None
        self.meta: dict = {}
        self._written = False
        self._pid = os.getpid()
        self._profile_steps = profile_steps()
        self._profiler: StepProfiler | None = None
        atexit.register(self.dump)

    def epoch_start(self) -> None:
        if self.cuda:
            _synchronize()
        self.epochs.append({"start": time.perf_counter(), "steps": [], "samples": 0})

    def epoch_end(self) -> None:
        """Call when the epoch's work is done (validation, checkpoint); only the last epoch's is needed."""
        if self.cuda:
            _synchronize()
        self.epochs[-1]["end"] = time.perf_counter()

    def step_end(self, samples: int, last: bool = False) -> None:
        """Call after the optimizer step of each training batch; ``samples`` this process trained on.

        ``last``: the epoch's last training step (on a GPU its stamp waits for the device).
        """
        if self.cuda and (last or self.first_step_unix is None):
            _synchronize()
        now = time.perf_counter()
        if self.first_step_unix is None:
            self.first_step_unix = time.time()
        epoch = self.epochs[-1]
        epoch["steps"].append(now)
        epoch["samples"] += samples
        if self._profile_steps and len(self.epochs) == 2:
            self._profile(len(epoch["steps"]))

    def _profile(self, step: int) -> None:
        """Start the profiler after SKIP_STEPS steps of the second epoch; stop it N steps later."""
        if step == SKIP_STEPS and self._profiler is None:
            self._profiler = StepProfiler(self.cuda)
            self._profiler.start()
        elif step == SKIP_STEPS + self._profile_steps and self._profiler is not None:
            self.meta["profile"] = self._profiler.stop(self._profile_steps)

    def dump(self) -> None:
        if self._written or os.getpid() != self._pid:  # a forked child (e.g. a DataLoader worker) never writes
            return
        self._written = True
        import torch  # already imported by every contender

        record = {
            "rank": self.rank,
            "pid": os.getpid(),
            "argv": sys.argv,
            "threads": torch.get_num_threads(),
            "first_step_unix": self.first_step_unix,
            "exit_unix": time.time(),
            "epochs": self.epochs,
            **self.meta,
        }
        if self.cuda:
            record["peak_cuda_mb"] = torch.cuda.max_memory_allocated() / 2**20
            record["device"] = torch.cuda.get_device_name()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(record))


def _synchronize() -> None:
    import torch

    torch.cuda.synchronize()


def rank_path(prefix: str | os.PathLike, rank: int) -> Path:
    """Where rank ``rank`` of a run writes its timeline: ``<prefix>.rank<r>.json``."""
    return Path(f"{prefix}.rank{rank}.json")
