"""A worker's side of the links: join every server, push gradients and pull parameters, leave.

On a worker, Lightning's optimizer is replaced by :class:`PushPullOptimizer`: its ``step`` runs
Lightning's closure (forward and backward on the worker's batch), then sends each server the gradients
of the parameters it holds and copies back the parameters it answers with. The update itself happens
on the servers. The chief reads the other servers' shares with :func:`read_server`.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from src.engine.strategies.ps.coordination import JobStore
from src.engine.strategies.ps.link import (
    DONE,
    EVICTED,
    HEADER,
    JOIN,
    LEAVE,
    PUSH,
    READ,
    READ_STATE,
    Link,
    header,
)
from src.engine.strategies.ps.server import flat_copy, shaped_views


class ServerLost(Exception):
    """A server's link failed: the server died or froze."""

    def __init__(self, server: int, err: BaseException) -> None:
        super().__init__(f"server {server}: {err}")
        self.server = server


def _fill(flat: Tensor, tensors: Sequence[Tensor | None], like: Sequence[Tensor]) -> None:
    """``flat`` := the concatenation of ``tensors`` (zeros where a tensor is None: an unused parameter)."""
    parts = [(t if t is not None else torch.zeros_like(ref)).reshape(-1) for t, ref in zip(tensors, like, strict=True)]
    if parts:
        flat.copy_(torch.cat(parts))


class ServerClient:
    """One worker's links to every server.

    Args:
        jobs: the job's keys in the rendezvous store.
        worker: this worker's index among the workers.
        shards: for each server, the module parameters it holds (model order).
        buffers: the module's buffers (kept by server 0).
        timeout: how long a link waits for an answer; longer than any server's legitimate wait.
        start_timeout: how long joining may wait (at the start of the job, for every planned worker).
    """

    def __init__(self, jobs: JobStore, worker: int, shards: Sequence[Sequence[nn.Parameter]],
                 buffers: Sequence[Tensor], timeout: dt.timedelta, start_timeout: dt.timedelta) -> None:
        self.jobs, self.worker, self.timeout, self.start_timeout = jobs, worker, timeout, start_timeout
        self.shards, self.buffers = [list(s) for s in shards], list(buffers)
        pinned = any(p.is_cuda for s in self.shards for p in s) and torch.cuda.is_available()

        def cpu_flat(tensors: Sequence[Tensor], dtype: torch.dtype | None = None) -> Tensor:
            flat = flat_copy(tensors, torch.device("cpu"), dtype or (tensors[0].dtype if tensors else torch.float32))
            return flat.pin_memory() if pinned else flat

        self.grads_out = [cpu_flat(s) for s in self.shards]
        self.params_in = [cpu_flat(s) for s in self.shards]
        self.buffers_out = cpu_flat(self.buffers, torch.float64)
        self.buffers_in = cpu_flat(self.buffers, torch.float64)
        self.links: list[Link] = []
        self.incarnation = 0
        self.version = [0] * len(self.shards)  # updates each server had applied to the parameters last pulled
        self.done = False

    @property
    def _with_buffers(self) -> bool:
        return self.buffers_out.numel() > 0

    def _sent(self, server: int) -> list[Tensor]:
        """What a push sends server ``server``: its gradients, and server 0 the buffers too."""
        return [self.grads_out[server], *([self.buffers_out] if server == 0 and self._with_buffers else [])]

    def _received(self, server: int) -> list[Tensor]:
        """What a server answers with: its parameters, and server 0 the buffers too."""
        return [self.params_in[server], *([self.buffers_in] if server == 0 and self._with_buffers else [])]

    def join(self) -> None:
        """Ask every server for a link (a new incarnation of this worker), then pull the parameters. A worker
        that froze while joining, and was dropped for it, joins again."""
        while True:
            try:
                self._open_links()
                self._exchange(header(JOIN, self.worker, self.incarnation), [[] for _ in self.shards],
                               self.start_timeout)
                return
            except ServerLost as lost:
                if not self._dropped(lost):
                    raise
            self.leave()

    def _open_links(self) -> None:
        self.incarnation = self.jobs.add("incarnation", self.worker)
        keys = []
        for server in range(len(self.shards)):
            n = self.jobs.add("join", server, "count")
            self.jobs.store.set(self.jobs.key("join", server, n), f"worker {self.worker} {self.incarnation}")
            keys.append(self.jobs.key("link", server, self.worker, self.incarnation))
        self.links = []
        for server, key in enumerate(keys):
            try:
                self.links.append(Link(self.jobs.store, key, 1, self.timeout))
            except Exception as err:
                raise ServerLost(server, err) from err

    def _dropped(self, lost: ServerLost) -> bool:
        """Whether ``lost`` means that server closed this incarnation's link as frozen (it is alive: join
        again), not that it died or that the job ended meanwhile."""
        return self.jobs.ended() is None and self.jobs.was_dropped(lost.server, self.worker, self.incarnation)

    def push_pull(self, loss_sum: float, samples: int) -> None:
        """Send every server its gradients (and server 0 the buffers), then take the parameters they answer with."""
        for server, shard in enumerate(self.shards):
            _fill(self.grads_out[server], [p.grad for p in shard], shard)
        if self._with_buffers:
            _fill(self.buffers_out, self.buffers, self.buffers)
        payloads = [self._sent(s) for s in range(len(self.shards))]
        heads = [header(PUSH, self.worker, self.incarnation, loss_sum, samples, v) for v in self.version]
        try:
            status = self._exchange(heads, payloads)
        except ServerLost as lost:
            if not self._dropped(lost):
                raise
            status = EVICTED  # this worker froze and woke: that server closed its link, and is alive
        if status == EVICTED:  # a server dropped this worker as frozen: join again (this push is lost)
            self.leave()
            self.join()

    def _exchange(self, heads: Tensor | list[Tensor], payloads: list[list[Tensor]],
                  timeout: dt.timedelta | None = None) -> int:
        """Send each server its header and payload, all at once; receive every answer; worst status."""
        if isinstance(heads, Tensor):
            heads = [heads] * len(self.links)
        works = []
        for server, link in enumerate(self.links):
            try:
                works.append((server, link.send(heads[server], *payloads[server])))
            except Exception as err:
                raise ServerLost(server, err) from err
        worst = 0
        reply = torch.zeros(HEADER, dtype=torch.float64)
        for server, posted in works:
            try:
                for work in posted:
                    work.wait()
                self.links[server].recv(reply, *self._received(server), timeout=timeout)
            except Exception as err:
                raise ServerLost(server, err) from err
            status, self.version[server] = int(reply[0]), int(reply[1])
            worst = max(worst, status)
            self._copy_in(server)
        self.done = self.done or worst == DONE
        return worst

    @torch.no_grad()
    def _copy_in(self, server: int) -> None:
        for p, value in zip(self.shards[server], shaped_views(self.params_in[server], self.shards[server]), strict=True):
            p.copy_(value)
        if server == 0:
            for b, value in zip(self.buffers, shaped_views(self.buffers_in, self.buffers), strict=True):
                b.copy_(value)

    def leave(self, signum: int = 0) -> None:
        """Tell every server this incarnation is done, stopped by signal ``signum`` if not 0 (best effort: a
        server may be gone already)."""
        for link in self.links:
            try:
                for work in link.send(header(LEAVE, self.worker, self.incarnation, signum)):
                    work.wait()
            except Exception:  # noqa: S112 - leaving a server that is gone needs nothing more
                continue
            finally:
                link.close()
        self.links = []


class PushPullOptimizer(Optimizer):
    """A worker's optimizer: ``step`` = Lightning's closure, then push the gradients and pull the parameters.

    It has the configured optimizer's parameter groups (the learning-rate monitor and gradient clipping
    read them) and no state: the servers keep it.
    """

    def __init__(self, optimizer: Optimizer, client: ServerClient, batch_size: Callable[[], int]) -> None:
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.client, self.batch_size = client, batch_size

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        samples = self.batch_size()
        loss_sum = float(loss.detach()) * samples if isinstance(loss, Tensor) else 0.0
        self.client.push_pull(loss_sum, samples)
        return loss


def read_server(jobs: JobStore, server: int, like: Sequence[Tensor], timeout: dt.timedelta,
                with_state: bool = False) -> tuple[Tensor, dict[str, Any] | None]:
    """The chief reads server ``server``'s parameters (a flat tensor ordered like ``like``), and its optimizer
    state with ``with_state``, over a link of its own (one per read: between reads it would sit idle)."""
    reader = jobs.add("readers")
    n = jobs.add("join", server, "count")
    jobs.store.set(jobs.key("join", server, n), f"reader 0 {reader}")
    try:
        link = Link(jobs.store, jobs.key("read", server, 0, reader), 1, timeout)
        for work in link.send(header(READ_STATE if with_state else READ)):
            work.wait()
        reply = torch.zeros(HEADER, dtype=torch.float64)
        params = flat_copy(like, torch.device("cpu"), like[0].dtype if like else torch.float32)
        link.recv(reply, params)
        state = link.recv_object() if with_state else None
        link.close()
    except Exception as err:
        raise ServerLost(server, err) from err
    return params, state
