"""A link: one worker's connection to one server, a two-process gloo group of its own.

Why not the job's process group: gloo connects every pair of ranks once, at start-up, and a group whose
member died can never take that rank back. A parameter server must outlive its workers and take a
restarted one back, so each (server, worker, incarnation) gets its own two-process
:class:`torch.distributed.ProcessGroupGloo` on a prefix of the rendezvous store (as torchft rebuilds
its groups per quorum). A worker that dies breaks its own links and nothing else: the server's next
receive on them fails at once ("Connection closed by peer"), and a frozen peer fails it after the
group's timeout. Messages are point-to-point sends of CPU tensors: a fixed-size header, then the
payload tensors, in the same order on both sides. Why not ``torch.distributed.rpc``: its TensorPipe
backend is in maintenance mode, and its dynamic membership expects a leaving process to call
``shutdown``, which a killed one never does.
"""

from __future__ import annotations

import datetime as dt
import io
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

HEADER = 8  # float64 slots: exact for integers below 2**53

# what a worker (or the chief, reading) asks a server
JOIN, PUSH, LEAVE, READ, READ_STATE = 1, 2, 3, 4, 5
# how the server answers
OK, DONE, EVICTED = 0, 1, 2


def header(*values: float) -> Tensor:
    """A message header: ``values`` in the first slots, zeros after."""
    out = torch.zeros(HEADER, dtype=torch.float64)
    out[: len(values)] = torch.tensor(values, dtype=torch.float64)
    return out


class Link:
    """The two ends of one link; ``rank`` 0 is the server's end, 1 the client's.

    Building one blocks until the other end builds it too (or ``timeout`` passes); every send and
    receive fails after ``timeout`` without an answer.
    """

    def __init__(self, store: dist.Store, prefix: str, rank: int, timeout: dt.timedelta) -> None:
        self.group = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, 2, timeout)
        self.peer = 1 - rank
        self.closed = False

    def send(self, *tensors: Tensor) -> list[Any]:
        """Post one send per tensor; returns the works to wait on (a gloo send completes once the peer receives)."""
        return [self.group.send([t], self.peer, 0) for t in tensors]

    def recv(self, *tensors: Tensor, timeout: dt.timedelta | None = None) -> None:
        """Receive into ``tensors``, in order; ``timeout`` replaces the link's for this message."""
        for t in tensors:
            work = self.group.recv([t], self.peer, 0)
            work.wait(timeout) if timeout is not None else work.wait()

    def send_object(self, obj: Any) -> None:
        """``obj`` (tensors and plain values) as ``torch.save`` bytes: their length, then the bytes."""
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        data = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
        for work in self.send(torch.tensor([data.numel()], dtype=torch.int64), data):
            work.wait()

    def recv_object(self) -> Any:
        """What :meth:`send_object` sent, loaded with ``weights_only=True`` (no code runs)."""
        size = torch.zeros(1, dtype=torch.int64)
        self.recv(size)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        self.recv(data)
        return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)

    def close(self) -> None:
        """Stop using the link; its sockets close when the group is released."""
        self.closed = True
        self.group = None
