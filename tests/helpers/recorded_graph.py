"""A CPU stand-in for ``torch.cuda.CUDAGraph``, so the captured step's contract is tested where CI runs.

A CUDA capture records device work and runs none of it; a replay runs that work again on the same memory
and runs no Python at all. This stand-in keeps both halves of that contract on a CPU:

* ``capture()`` records every aten op under a ``TorchDispatchMode``. The ops do run (a CPU cannot record
  without running), so every tensor that existed before the capture and was written during it is
  restored afterwards, and so is the RNG state: the capture leaves no trace, as on a GPU.
* ``replay()`` re-runs the recorded ops with the recorded arguments, and copies each fresh result into
  the tensor the capture produced, so later ops (and anyone holding those tensors: gradients, the step's
  outputs) see the new values at the old addresses. Python scalars baked into an op stay as recorded.
* A host read inside the capture (``.item()``, ``bool(tensor)``) raises, as it fails a CUDA capture.

``pre_existing`` lists the tensors the graph reads or writes that it did not create (parameters, optimizer
state, input buffers): a replay is right only while they are the tensors the run still uses.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

HOST_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default,
              torch.ops.aten.equal.default}


def storage_key(t: Tensor) -> int:
    return t.untyped_storage().data_ptr()


def written_args(func: Any, args: tuple, kwargs: dict) -> list[Tensor]:
    """The tensors an op writes in place (its schema's ``Tensor(a!)`` arguments)."""
    written = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        written += [t for t in tree_flatten(value)[0] if isinstance(t, Tensor)]
    return written


class Recording(TorchDispatchMode):
    def __init__(self, graph: RecordedGraph) -> None:
        super().__init__()
        self.graph = graph
        self.created: set[int] = set()  # storages allocated inside the capture
        self.saved: dict[int, tuple[torch.UntypedStorage, torch.UntypedStorage]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in HOST_READS:
            raise RuntimeError(f"{func} reads a device value on the host inside the captured step")
        for t in written_args(func, args, kwargs):
            key = storage_key(t)
            if key not in self.created and key not in self.saved:
                storage = t.untyped_storage()
                self.saved[key] = (storage, storage.clone())
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, Tensor) and storage_key(t) not in self.created:
                self.graph.pre_existing.setdefault(storage_key(t), t)
        out = func(*args, **kwargs)
        fresh = all(r.alias_info is None for r in func._schema.returns)
        if fresh:
            self.created.update(storage_key(t) for t in tree_flatten(out)[0] if isinstance(t, Tensor))
        self.graph.ops.append((func, args, kwargs, out if fresh else None))
        return out


class RecordedGraph:
    """``capture()`` and ``replay()``, as :class:`src.engine.steps.step_capture.CudaStepGraph` has them."""

    def __init__(self) -> None:
        self.ops: list[tuple[Any, tuple, dict, Any]] = []
        self.pre_existing: dict[int, Tensor] = {}
        self.replays = 0

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        rng = torch.get_rng_state()
        recording = Recording(self)
        try:
            with recording:
                yield
        finally:
            for storage, before in recording.saved.values():
                storage.copy_(before)
            torch.set_rng_state(rng)
        for key in recording.created:
            self.pre_existing.pop(key, None)

    @torch.no_grad()  # the recorded ops are autograd's output already (backward included)
    def replay(self) -> None:
        for func, args, kwargs, recorded in self.ops:
            out = func(*args, **kwargs)
            if recorded is not None:
                for target, value in zip(tree_flatten(recorded)[0], tree_flatten(out)[0], strict=True):
                    if isinstance(target, Tensor):
                        target.copy_(value)
        self.replays += 1
