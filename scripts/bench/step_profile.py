"""Where a training step's time goes: host time, device busy time, idle gaps, launches and sync points.

:class:`StepProfiler` wraps ``torch.profiler`` around a window of steady training steps. It is started and
stopped by :class:`scripts.bench.timeline.Timeline` when ``BENCH_PROFILE_STEPS`` is set, so every
contender (the project, bare Lightning, the plain loop) is profiled over the same kind of window. The
summary per step:

* ``wall_ms``: host wall time, the device synchronized at both ends of the window;
* ``cpu_ms``: CPU time of the training thread (``time.thread_time``), what Python and the launches cost;
* ``gpu_busy_ms``: the union of the device's kernel, copy and memset intervals; ``gpu_idle_ms`` is the
  rest of the wall time, when the device waited for the host;
* ``kernels``: device kernels launched per step;
* ``syncs``: host-device synchronisations per step, by the code that caused them, from
  ``torch.cuda.set_sync_debug_mode("warn")`` (a blocking copy, ``.item()``, ``.cpu()``, ``nonzero`` ...)
  and from the profiler's runtime calls (``cudaStreamSynchronize`` and friends);
* ``top_ops``: the operators with the most host self time.

On a CPU only ``wall_ms``, ``cpu_ms`` and ``top_ops`` mean something.
"""

from __future__ import annotations

import collections
import os
import time
import traceback
import warnings
from typing import Any

import torch

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy ")
SKIP_STEPS = 20  # steps of the profiled epoch left out first: no start-of-epoch work in the window


def profile_steps() -> int:
    """How many steps to profile (``BENCH_PROFILE_STEPS``), 0 for none."""
    return int(os.environ.get("BENCH_PROFILE_STEPS") or 0)


class StepProfiler:
    """Profiles the steps between :meth:`start` and :meth:`stop`; :meth:`stop` returns the summary per step."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self._sync_sites: collections.Counter[str] = collections.Counter()
        self._prof: Any = None
        self._warnings: Any = None

    def start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.synchronize()
        self._prof = torch.profiler.profile(activities=activities)
        self._prof.__enter__()
        if self.cuda:
            self._warnings = warnings.catch_warnings()
            self._warnings.__enter__()
            warnings.simplefilter("always")
            warnings.showwarning = self._note_sync
            torch.cuda.set_sync_debug_mode("warn")
        self._t0, self._c0 = time.perf_counter(), time.thread_time()

    def _note_sync(self, message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-2] if "/torch/" not in f.filename]
        where = next((f"{_short(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames)), "?")
        self._sync_sites[f"{str(message).split(':')[0][:60]} <- {where}"] += 1

    def stop(self, steps: int) -> dict:
        if self.cuda:
            torch.cuda.set_sync_debug_mode(0)
            self._warnings.__exit__(None, None, None)
            torch.cuda.synchronize()
        wall, cpu = time.perf_counter() - self._t0, time.thread_time() - self._c0
        self._prof.__exit__(None, None, None)
        return summarize(self._prof, steps, wall, cpu, self._sync_sites)


def summarize(prof: Any, steps: int, wall_s: float, cpu_s: float, sync_sites: collections.Counter) -> dict:
    """The per-step summary of a finished ``torch.profiler.profile``."""
    device_spans, kernels, runtime_syncs = [], 0, collections.Counter()
    host_self: collections.Counter[str] = collections.Counter()
    for event in prof.events():
        on_device = getattr(event, "device_type", None) == torch.autograd.DeviceType.CUDA
        if on_device and getattr(event, "is_user_annotation", False):
            continue  # a record_function range mirrored on the GPU timeline: it spans idle time too
        if on_device:
            device_spans.append((event.time_range.start, event.time_range.end))
            kernels += not event.name.startswith(("Memcpy", "Memset"))
        else:
            host_self[event.name] += event.self_cpu_time_total
            if event.name.startswith(SYNC_CALLS) or event.name == "cudaMemcpy":
                runtime_syncs[event.name] += 1
    busy_us = _union_length(device_spans)
    per = max(steps, 1)
    return {
        "steps": steps,
        "wall_ms": 1e3 * wall_s / per,
        "cpu_ms": 1e3 * cpu_s / per,
        "gpu_busy_ms": busy_us / 1e3 / per,
        "gpu_idle_ms": max(1e3 * wall_s - busy_us / 1e3, 0.0) / per,
        "kernels": kernels / per,
        "syncs": sum(sync_sites.values()) / per,
        "sync_sites": {site: n / per for site, n in sync_sites.most_common(8)},
        "runtime_syncs": {name: n / per for name, n in runtime_syncs.most_common()},
        "top_ops": {name: us / 1e3 / per for name, us in host_self.most_common(12)},
    }


def _union_length(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(spans):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def _short(path: str) -> str:
    return "/".join(path.split(os.sep)[-3:])
