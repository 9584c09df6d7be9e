"""A server's shard of the model, and the rules that turn workers' pushes into updates.

A server holds its parameters in one flat tensor (each parameter is a view of it) and steps its own
copy of the module's optimizer over them. Each worker's link is served by a thread of its own
(:mod:`.serve`); this class is what those threads share, behind one lock:

* ``max_staleness=0``: bulk synchronous. A round is one push from every live worker, all computed from
  the same parameters; when the last one arrives the server averages the round's gradients and takes
  one optimizer step, then every worker pulls. That is synchronous SGD with the global batch, for any
  optimizer. The round's buffers (BatchNorm statistics) are the lowest worker's, as DDP broadcasts rank
  0's.
* otherwise, asynchronous: each push is one optimizer step on its gradient divided by the planned
  number of workers W (a push is 1/W of the global batch, so W pushes move plain SGD as far as one
  synchronous step). Its buffers replace the server's. With ``max_staleness=s`` a worker gets its fresh
  parameters only once every live worker is at most ``s`` steps behind it (stale synchronous parallel:
  the parameters a worker reads hold every update up to ``s`` steps before its own); with ``None``
  nobody waits.

A joining worker starts at the current round (synchronous) or the slowest live worker's step, so it
holds nobody back. Once the planned number of updates is applied the server answers every push with
DONE and applies nothing more.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from src.engine.strategies.ps.link import DONE, EVICTED, OK
from src.engine.utils.errors import ConfigError

_GROUP_SKIP = ("params", "param_names")


def live_optimizer(optimizer: Optimizer, live: dict[int, Tensor]) -> Optimizer:
    """A copy of ``optimizer`` that steps ``live[id(p)]`` in place of each parameter ``p`` this server holds.

    The parameters it does not hold stay in their groups and never get a gradient, so they are skipped,
    hold no state, and the state dict numbers parameters as the whole model's optimizer does: the servers'
    states merge by index into one standard optimizer state dict.
    """
    groups = [{**{k: v for k, v in g.items() if k not in _GROUP_SKIP},
               "params": [live.get(id(p), p) for p in g["params"]]} for g in optimizer.param_groups]
    try:
        return type(optimizer)(groups, **optimizer.defaults)
    except TypeError as err:
        raise ConfigError(f"trainer=ps rebuilds the optimizer on each server as {type(optimizer).__name__}("
                          f"param_groups, **defaults), which it rejects ({err}); fix: use a torch.optim optimizer") from None


def flat_copy(tensors: Sequence[Tensor], device: torch.device, dtype: torch.dtype) -> Tensor:
    """One flat tensor holding copies of ``tensors``, in order."""
    if not tensors:
        return torch.zeros(0, device=device, dtype=dtype)
    return torch.cat([t.detach().reshape(-1).to(device=device, dtype=dtype) for t in tensors])


def shaped_views(flat: Tensor, like: Sequence[Tensor]) -> list[Tensor]:
    """Views of ``flat`` shaped like each of ``like``, one after the other."""
    views, offset = [], 0
    for t in like:
        views.append(flat[offset:offset + t.numel()].view(t.shape))
        offset += t.numel()
    return views


@dataclass
class Member:
    """A worker as a server sees it: which incarnation of it is live, and its step (its clock)."""

    incarnation: int
    clock: int


class ParameterServer:
    """One server's parameters, optimizer and workers.

    Args:
        params: the module's parameters this server holds, in model order.
        optimizer: the optimizer Lightning built over the whole module. It keeps the schedule (learning-rate
            schedulers step it); the server steps a copy over its own tensors and reads the hyper-parameters
            from it before every step.
        buffers: the module's buffers when this server keeps them (the chief), else none.
        num_workers: the planned number of workers W.
        max_staleness: ``None`` (nobody waits), or ``s >= 0`` (0: bulk synchronous).
        device: where the parameters and the optimizer state live.
        log: called with ``(worker, what happened)`` when a worker joins or leaves.
    """

    def __init__(self, params: Sequence[nn.Parameter], optimizer: Optimizer, buffers: Sequence[Tensor],
                 num_workers: int, max_staleness: int | None, device: torch.device,
                 log: Callable[[int, str], None] = lambda worker, what: None) -> None:
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1:
            raise ConfigError(f"trainer=ps sends a server's parameters as one tensor, and they mix dtypes "
                              f"{sorted(map(str, dtypes))}; fix: give the model one dtype")
        self.dtype = dtypes.pop() if dtypes else torch.float32
        self.params, self.buffers = list(params), list(buffers)
        self.flat = flat_copy(self.params, device, self.dtype)
        self.grad = torch.zeros_like(self.flat)
        self.views = shaped_views(self.flat, self.params)
        for view, grad in zip(self.views, shaped_views(self.grad, self.params), strict=True):
            view.grad = grad  # the optimizer reads every update's gradient from self.grad
        self.buffer_flat = flat_copy(self.buffers, torch.device("cpu"), torch.float64)
        self.schedule = optimizer
        self.optimizer = live_optimizer(optimizer, {id(p): v for p, v in zip(self.params, self.views, strict=True)})
        self.num_workers, self.max_staleness, self.log = num_workers, max_staleness, log
        self.sync = max_staleness == 0
        self.cond = threading.Condition()
        self.members: dict[int, Member] = {}
        self.seen: set[int] = set()  # workers that have joined once
        self.opened = False
        self.started = False  # every planned worker joined once (or the start timed out): joins no longer wait
        self.closed = False
        self.applied = 0  # optimizer steps taken (rounds when synchronous, pushes otherwise)
        self.planned: int | None = None
        self.last_clock = 0  # a joiner's clock when no worker is live
        self.empty_since: float | None = time.monotonic()
        self._round_sum = torch.zeros_like(self.flat) if self.sync else None
        self._round_pushes = 0
        self._round_buffers_from: int | None = None
        self._loss = self._samples = self._staleness = self._pushes = 0.0

    # -- set-up ------------------------------------------------------------------------------------
    def open(self, applied: int, planned: int | None) -> None:
        """Start taking workers: ``applied`` updates are already in the parameters, ``planned`` in all."""
        with self.cond:
            self.applied, self.planned, self.last_clock = applied, planned, applied if self.sync else 0
            self.opened = True
            self.cond.notify_all()

    def _ready(self) -> bool:
        """Joins wait until the server is open and, the first time, until every planned worker has joined, so
        the job starts with all of them (a synchronous run's first round included)."""
        if self.closed:
            return True
        self.started = self.started or (self.opened and len(self.members) >= self.num_workers)
        return self.started

    def reload(self) -> None:
        """Copy the module's parameters and buffers (e.g. just restored from a checkpoint) into the server."""
        with self.cond, torch.no_grad():
            self.flat.copy_(flat_copy(self.params, self.flat.device, self.dtype))
            self.buffer_flat.copy_(flat_copy(self.buffers, torch.device("cpu"), torch.float64))

    # -- workers -----------------------------------------------------------------------------------
    def join(self, worker: int, incarnation: int, timeout_s: float) -> Member:
        """Register ``worker``'s new incarnation (an older one is dropped); returns once the server is ready.

        At the start of the job that is when every planned worker has joined, or ``timeout_s`` has passed: then
        the job starts with the workers it has.
        """
        with self.cond:
            if not self.cond.wait_for(lambda: self.opened or self.closed, timeout=timeout_s):
                raise TimeoutError("the server did not open in time")
            live = [m.clock for m in self.members.values()]
            clock = self.applied if self.sync else (min(live) if live else self.last_clock)
            rejoin = worker in self.seen
            self.seen.add(worker)
            member = self.members[worker] = Member(incarnation, clock)
            self.empty_since = None
            self.cond.notify_all()
            if not self.cond.wait_for(self._ready, timeout=timeout_s):
                self.started = True  # a planned worker never came: start with those here
                self.cond.notify_all()
        self.log(worker, f"joined{' again' if rejoin else ''} at {'round' if self.sync else 'step'} {member.clock}")
        return member

    def leave(self, worker: int, incarnation: int, reason: str) -> None:
        """``worker``'s incarnation is gone (finished, died or froze); the others carry on without it."""
        with self.cond:
            member = self.members.get(worker)
            if member is None or member.incarnation != incarnation:
                return
            del self.members[worker]
            self.last_clock = max(self.last_clock, member.clock)
            if not self.members:
                self.empty_since = time.monotonic()
            if self.sync:
                self._complete_round()
            self.cond.notify_all()
        self.log(worker, reason)

    def push(self, worker: int, incarnation: int, grad: Tensor, buffers: Tensor | None, loss_sum: float,
             samples: float, pulled: int) -> int:
        """Apply one push (see the module docstring) and wait until ``worker`` may go on; the reply status."""
        with self.cond:
            member = self.members.get(worker)
            if member is None or member.incarnation != incarnation:
                return EVICTED
            if self.done:
                return DONE
            self._loss, self._samples = self._loss + loss_sum, self._samples + samples
            self._staleness, self._pushes = self._staleness + (self.applied - pulled), self._pushes + 1
            if self.sync:
                self._round_sum.add_(grad.to(self.flat.device))
                self._round_pushes += 1
                if buffers is not None and (self._round_buffers_from is None or worker < self._round_buffers_from):
                    self.buffer_flat.copy_(buffers)
                    self._round_buffers_from = worker
                member.clock += 1
                self._complete_round()
            else:
                self.grad.copy_(grad)
                if buffers is not None:
                    self.buffer_flat.copy_(buffers)
                self._step()
                member.clock += 1
            self.cond.notify_all()
            self.cond.wait_for(lambda: self._released(worker, member) or self.done or self.closed)
            return DONE if self.done else OK

    def _released(self, worker: int, member: Member) -> bool:
        if self.members.get(worker) is not member:
            return True  # dropped meanwhile: its next push learns that it was evicted
        if self.sync:
            return self.applied >= member.clock
        if self.max_staleness is None:
            return True
        return min(m.clock for m in self.members.values()) >= member.clock - self.max_staleness

    def _complete_round(self) -> None:
        """Synchronous: once every live worker has pushed this round, one step on the round's mean gradient."""
        if self._round_pushes == 0 or any(m.clock <= self.applied for m in self.members.values()):
            return
        self.grad.copy_(self._round_sum).div_(self._round_pushes)
        self._step()
        self._round_sum.zero_()
        self._round_pushes, self._round_buffers_from = 0, None

    def _step(self) -> None:
        for live, scheduled in zip(self.optimizer.param_groups, self.schedule.param_groups, strict=True):
            live.update({k: v for k, v in scheduled.items() if k not in _GROUP_SKIP})
            if not self.sync:  # a push is 1/W of the global batch: a 1/W step, for SGD and Adam alike
                live["lr"] = scheduled["lr"] / self.num_workers
        self.optimizer.step()
        self.applied += 1

    @property
    def done(self) -> bool:
        return self.closed or (self.planned is not None and self.applied >= self.planned)

    # -- what the strategy reads -------------------------------------------------------------------
    def wait_applied(self, target: int, timeout_s: float) -> bool:
        """Block until ``target`` updates are applied (True), the server is done, or ``timeout_s`` passes."""
        with self.cond:
            self.cond.wait_for(lambda: self.applied >= target or self.done, timeout=timeout_s)
            return self.applied >= target

    def take_progress(self) -> dict[str, float]:
        """Loss, samples, mean staleness (in updates) and live workers since the last call."""
        with self.cond:
            out = {"loss_sum": self._loss, "samples": self._samples, "live": len(self.members),
                   "staleness": self._staleness / self._pushes if self._pushes else float("nan")}
            self._loss = self._samples = self._staleness = self._pushes = 0.0
        return out

    def read(self, params_out: Tensor, buffers_out: Tensor | None = None) -> int:
        """Copy the current parameters (and buffers) into the given tensors; the number of updates they hold."""
        with self.cond:
            params_out.copy_(self.flat)
            if buffers_out is not None:
                buffers_out.copy_(self.buffer_flat)
            return self.applied

    def write_back(self) -> None:
        """Copy the server's parameters and buffers into the module (for evaluation and checkpoints)."""
        with self.cond, torch.no_grad():
            for p, value in zip(self.params, self.views, strict=True):
                p.copy_(value)
            for b, value in zip(self.buffers, shaped_views(self.buffer_flat, self.buffers), strict=True):
                b.copy_(value)

    def optimizer_state(self) -> dict[str, Any]:
        """The optimizer's state dict (this server's parameters only), copied under the lock, with the schedule's
        group settings: the live optimizer's learning rate is 1/W of it when asynchronous, and a resume loads
        these settings into the schedule."""
        with self.cond:
            state = copy.deepcopy(self.optimizer.state_dict())
            for saved, scheduled in zip(state["param_groups"], self.schedule.param_groups, strict=True):
                saved.update(copy.deepcopy({k: v for k, v in scheduled.items() if k not in _GROUP_SKIP}))
            return state

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        """Load a whole-model optimizer state dict and keep this server's parameters' entries only."""
        held = {id(v) for v in self.views}
        with self.cond:
            self.optimizer.load_state_dict(state)
            for p in [p for p in self.optimizer.state if id(p) not in held]:
                del self.optimizer.state[p]

    def close(self, wait_for_workers_s: float = 0.0) -> None:
        """No more updates; every waiting worker gets DONE. With ``wait_for_workers_s``, block until every live
        worker has left (each learns DONE at its next push and says goodbye), or that long: a server that
        exits first would look dead to them."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()
            self.cond.wait_for(lambda: not self.members, timeout=wait_for_workers_s)
