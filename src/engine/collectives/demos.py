"""The three teaching examples of message passing, each run by every rank and narrated rank by rank.

* :func:`blocking_send_recv`: ``send``/``recv`` return only when the transfer is done.
* :func:`non_blocking_send_recv`: ``isend``/``irecv`` return a request at once; the data is only safe to
  read (receiver) or overwrite (sender) after ``wait()``.
* :func:`group_all_reduce`: ``all_reduce`` over a group made with ``new_group`` (every rank must call
  ``new_group``, members or not).

Each returns this rank's lines; :func:`gather_lines` collects them on rank 0 in rank order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from src.engine.collectives.runtime import comm_device


def _payload(device: torch.device) -> torch.Tensor:
    return torch.arange(1, 5, dtype=torch.float32, device=device)


def blocking_send_recv() -> list[str]:
    """Rank 0 sends a tensor to rank 1 with blocking calls; other ranks watch."""
    rank, device = dist.get_rank(), comm_device()
    tensor = torch.zeros(4, device=device)
    if rank == 0:
        tensor = _payload(device)
        dist.send(tensor, dst=1)  # returns once the data has left this buffer
        return [f"rank 0: sent {tensor.tolist()} to rank 1 (send returned: the buffer may be reused)"]
    if rank == 1:
        dist.recv(tensor, src=0)  # blocks until the data has arrived
        ok = torch.equal(tensor.cpu(), _payload(torch.device("cpu")))
        return [f"rank 1: received {tensor.tolist()} from rank 0 ({'correct' if ok else 'WRONG'})"]
    return [f"rank {rank}: not involved, tensor stays {tensor.tolist()}"]


def non_blocking_send_recv() -> list[str]:
    """Rank 0 sends to rank 1 with isend/irecv; the tensor is only read after ``wait()``."""
    rank, device = dist.get_rank(), comm_device()
    tensor = torch.zeros(4, device=device)
    if rank == 0:
        tensor = _payload(device)
        request = dist.isend(tensor, dst=1)
        lines = ["rank 0: isend started; must not modify the tensor until wait()"]
        request.wait()
        return [*lines, f"rank 0: wait() returned, {tensor.tolist()} is out"]
    if rank == 1:
        request = dist.irecv(tensor, src=0)
        lines = ["rank 1: irecv started; the tensor may still hold zeros"]
        request.wait()
        ok = torch.equal(tensor.cpu(), _payload(torch.device("cpu")))
        return [*lines, f"rank 1: after wait() received {tensor.tolist()} ({'correct' if ok else 'WRONG'})"]
    return [f"rank {rank}: not involved"]


def group_all_reduce() -> list[str]:
    """Ranks 0 and 1 form a group and all-reduce ``rank + 1``: members get 3, other ranks are untouched."""
    rank, device = dist.get_rank(), comm_device()
    members = [0, 1]
    group = dist.new_group(members)  # collective over the world group: every rank calls it
    tensor = torch.full((4,), float(rank + 1), device=device)
    if rank in members:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        ok = torch.all(tensor == 3).item()
        line = f"rank {rank}: all_reduce(SUM) over group {members} -> {tensor.tolist()} ({'correct' if ok else 'WRONG'})"
        dist.destroy_process_group(group)
        return [line]
    return [f"rank {rank}: not in group {members}, keeps {tensor.tolist()}"]


def gather_lines(lines: list[str]) -> list[str] | None:
    """Every rank's lines, in rank order, on rank 0 (None elsewhere)."""
    world = dist.get_world_size()
    out: list[list[str]] | None = [[] for _ in range(world)] if dist.get_rank() == 0 else None
    dist.gather_object(lines, out, dst=0)
    return [line for rank_lines in out for line in rank_lines] if out is not None else None


DEMOS = {"blocking": blocking_send_recv, "non_blocking": non_blocking_send_recv, "all_reduce": group_all_reduce}
