"""Bandwidth-optimal ring all-reduce written with point-to-point messages only.

The flat buffer is cut into ``n`` chunks. A reduce-scatter phase (``n - 1`` steps) leaves every rank owning
one fully reduced chunk; an all-gather phase (``n - 1`` steps) circulates those chunks. Each rank sends
``2 (n - 1) / n`` of the buffer in total, which is the lower bound for all-reduce (Patarasuk & Yuan; the
Baidu "ring all-reduce"). Step ``t`` of both phases receives chunk ``(r - t - 1) % n`` from the left
neighbour and forwards it at step ``t + 1``, so the two phases form one stream.

On gloo/mpi the chunks are further cut into segments and pipelined: a segment is reduced and forwarded as
soon as it arrives while the next ones are still on the wire. nccl runs a rank's point-to-point calls in
order on one stream, so a receive posted on its own blocks the sends behind it on every rank: there, each
step is one ``batch_isend_irecv`` of whole chunks by default, and the pipelined schedule posts each
segment's receive and send together in one batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["RING_REDUCE_OPS", "chunk_bounds", "compare_with_all_reduce", "release_workspace", "ring_all_reduce"]

DEFAULT_SEGMENT_BYTES = 2 << 20  # pipelining grain: small enough to overlap, large enough to amortise a call
# Elementwise ops on fewer elements than ATen's parallel grain (32768) run on the calling thread. Reducing
# in such pieces keeps the ring single-threaded like gloo's own reduction: with several ranks per machine,
# intra-op thread pools of every rank fight for the cores and one 128K-element add_ can take milliseconds.
REDUCE_PIECE = 32768

# In-place combine ``acc <- acc (op) incoming`` for each supported ReduceOp.
RING_REDUCE_OPS = {
    dist.ReduceOp.SUM: lambda acc, inc: acc.add_(inc),
    dist.ReduceOp.PRODUCT: lambda acc, inc: acc.mul_(inc),
    dist.ReduceOp.MAX: lambda acc, inc: torch.maximum(acc, inc, out=acc),
    dist.ReduceOp.MIN: lambda acc, inc: torch.minimum(acc, inc, out=acc),
}


def _reduce_into(combine, acc: torch.Tensor, incoming: torch.Tensor) -> None:
    """``acc <- acc (op) incoming`` in serial pieces (see :data:`REDUCE_PIECE`)."""
    if acc.device.type != "cpu" or torch.get_num_threads() == 1:  # already serial: one call
        combine(acc, incoming)
        return
    for start in range(0, acc.numel(), REDUCE_PIECE):
        combine(acc[start:start + REDUCE_PIECE], incoming[start:start + REDUCE_PIECE])


def chunk_bounds(numel: int, parts: int) -> list[int]:
    """Offsets ``[0, ..., numel]`` cutting ``numel`` elements into ``parts`` chunks differing by at most one."""
    base, extra = divmod(numel, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds


def _supports_coalescing(group: dist.ProcessGroup | None, device: torch.device) -> bool:
    # imported here, so ranks that never run the ring skip Lightning's import
    from src.engine.utils import lightning_compat as compat

    return compat.backend_supports_coalescing(group if group is not None else dist.group.WORLD, device)


_WORKSPACE: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _workspace(numel: int, like: torch.Tensor) -> torch.Tensor:
    """A reusable receive buffer on ``like``'s device and dtype: a fresh large allocation per call costs page
    faults on every call."""
    key = (like.dtype, like.device)
    buf = _WORKSPACE.get(key)
    if buf is None or buf.numel() < numel:
        buf = _WORKSPACE[key] = like.new_empty(numel)
    return buf[:numel]


def release_workspace() -> None:
    """Free the cached receive buffers (they are kept between calls for speed)."""
    _WORKSPACE.clear()


def ring_all_reduce(
    tensor: torch.Tensor,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    segment_bytes: int = DEFAULT_SEGMENT_BYTES,
    pipelined: bool | None = None,
) -> torch.Tensor:
    """Reduce ``tensor`` over ``group`` in place, like ``dist.all_reduce``, and return it.

    ``op`` is one of SUM, PRODUCT, MAX, MIN. ``segment_bytes`` sets the pipelining grain;
    ``pipelined=None`` picks the segmented schedule unless the backend coalesces p2p calls (nccl).
    """
    if op not in RING_REDUCE_OPS:
        raise ValueError(f"ring_all_reduce supports {sorted(str(o) for o in RING_REDUCE_OPS)}, not {op}")
    n = dist.get_world_size(group)
    if n == 1 or tensor.numel() == 0:
        return tensor
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
    coalescing = _supports_coalescing(group, flat.device)
    if pipelined is None:
        pipelined = not coalescing
    if pipelined:
        seg = max(1, segment_bytes // flat.element_size())
        _ring_pipelined(flat, RING_REDUCE_OPS[op], group, n, dist.get_rank(group), seg, paired=coalescing)
    else:
        _ring_stepwise(flat, RING_REDUCE_OPS[op], group, n, dist.get_rank(group))
    if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
        tensor.copy_(flat.view_as(tensor))
    return tensor


def _ring_stepwise(flat: torch.Tensor, combine, group, n: int, rank: int) -> None:
    """One batched send/recv of whole chunks per step; the reduction follows each step."""
    bounds = chunk_bounds(flat.numel(), n)
    right, left = (rank + 1) % n, (rank - 1) % n
    scratch = _workspace(bounds[1] - bounds[0], flat)
    for t in range(2 * (n - 1)):
        s, r = (rank - t) % n, (rank - t - 1) % n
        send = flat[bounds[s]:bounds[s + 1]]
        dest = flat[bounds[r]:bounds[r + 1]]
        reducing = t < n - 1
        buf = scratch[: dest.numel()] if reducing else dest
        ops = []
        if send.numel():
            ops.append(dist.P2POp(dist.isend, send, group=group, group_peer=right))
        if buf.numel():
            ops.append(dist.P2POp(dist.irecv, buf, group=group, group_peer=left))
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
        if reducing and buf.numel():
            _reduce_into(combine, dest, buf)


def _ring_pipelined(flat: torch.Tensor, combine, group, n: int, rank: int, seg: int, paired: bool = False) -> None:
    """Segment-level pipeline: reduce and forward each segment as soon as it arrives.

    Every chunk is cut into the same number of segments. Step ``t`` receives chunk ``(rank - t - 1) % n``
    and step ``t + 1`` forwards that same chunk, so segment ``k`` can go on while segment ``k + 1`` is still
    arriving. Reduce-scatter steps land in one of two scratch buffers (step parity); all-gather steps land
    in the output itself, once the earlier send of that region (step ``t + 1 - n``) has completed.
    Receives are posted a step ahead; with ``paired`` (in-order p2p streams, nccl) each segment's receive
    goes out with its send instead, in one ``batch_isend_irecv``, so no rank's receive waits in front of
    its own send.
    """
    bounds = chunk_bounds(flat.numel(), n)
    steps = 2 * (n - 1)
    right, left = (rank + 1) % n, (rank - 1) % n
    cap = bounds[1] - bounds[0]
    nseg = max(1, -(-cap // seg))
    ws = _workspace(2 * cap, flat)
    scratch = (ws[:cap], ws[cap:])
    regions: list[list[tuple[int, int]]] = []  # regions[c][k]: element range of segment k of chunk c
    for c in range(n):
        offsets = chunk_bounds(bounds[c + 1] - bounds[c], nseg)
        regions.append([(bounds[c] + lo, bounds[c] + hi) for lo, hi in zip(offsets[:-1], offsets[1:], strict=True)])
    sends: list[list[dist.Work | None]] = [[None] * nseg for _ in range(steps)]
    recvs: list[list[dist.Work | None]] = [[None] * nseg for _ in range(steps)]
    bufs: list[list[torch.Tensor | None]] = [[None] * nseg for _ in range(steps)]

    def finish_send(t: int, k: int) -> None:
        if sends[t][k] is not None:
            sends[t][k].wait()
            sends[t][k] = None  # waiting a finished gloo send a second time hangs

    def recv_buffer(t: int, k: int) -> torch.Tensor | None:
        c = (rank - t - 1) % n
        lo, hi = regions[c][k]
        if hi == lo:
            return None
        if t < n - 1:
            bufs[t][k] = scratch[t % 2][lo - bounds[c]: hi - bounds[c]]
        else:
            finish_send(t + 1 - n, k)  # this region left at step t + 1 - n; do not overwrite it in flight
            bufs[t][k] = flat[lo:hi]
        return bufs[t][k]

    def post(t: int, k: int, recv: bool = True, send: bool = True) -> None:
        """Post segment ``k`` of step ``t``: its receive and/or its send (one batch when ``paired``)."""
        buf = recv_buffer(t, k) if recv else None
        lo, hi = regions[(rank - t) % n][k]
        out = flat[lo:hi] if send and hi > lo else None
        if not paired:
            if buf is not None:
                recvs[t][k] = dist.irecv(buf, group=group, group_src=left, tag=t)
            if out is not None:
                sends[t][k] = dist.isend(out, group=group, group_dst=right, tag=t)
            return
        ops = [dist.P2POp(dist.irecv, buf, group=group, group_peer=left, tag=t)] if buf is not None else []
        ops += [dist.P2POp(dist.isend, out, group=group, group_peer=right, tag=t)] if out is not None else []
        works = dist.batch_isend_irecv(ops) if ops else []
        if len(works) == len(ops):  # one handle per call (gloo)
            recvs[t][k] = works[0] if buf is not None else None
            sends[t][k] = works[-1] if out is not None else None
        elif works:  # one handle for the whole batch (nccl)
            recvs[t][k], sends[t][k] = (works[0], None) if buf is not None else (None, works[0])

    for k in range(nseg):
        post(0, k)
    for t in range(steps):
        nxt = t + 1 if t + 1 < steps else None
        # With 2 ranks the all-gather receive overwrites the region being sent this very step: post it per
        # segment once that send is done. Otherwise post the whole next step now (paired: with the sends).
        ahead = not paired and nxt is not None and (nxt < n - 1 or n > 2)
        if ahead:
            for k in range(nseg):
                post(nxt, k, send=False)
        for k in range(nseg):
            if nxt is not None and not ahead and not paired:
                post(nxt, k, send=False)
            if recvs[t][k] is not None:
                recvs[t][k].wait()
                recvs[t][k] = None
                if t < n - 1:
                    lo, hi = regions[(rank - t - 1) % n][k]
                    _reduce_into(combine, flat[lo:hi], bufs[t][k])
                bufs[t][k] = None
            if nxt is not None:
                post(nxt, k, recv=paired)
    for t in range(steps):
        for k in range(nseg):
            finish_send(t, k)


def compare_with_all_reduce(
    numels: Sequence[int],
    dtypes: Sequence[torch.dtype] = (torch.float32, torch.float64, torch.int64),
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
    seed: int = 0,
) -> list[dict]:
    """Run :func:`ring_all_reduce` and ``dist.all_reduce`` on the same rank-dependent data; one row per case.

    The data are small integers (also in float tensors), so any summation order gives the exact same
    result and the two must be bit-identical.
    """
    rank = dist.get_rank(group)
    rows = []
    for numel in numels:
        for dtype in dtypes:
            gen = torch.Generator().manual_seed(seed * 1000 + rank)
            data = torch.randint(-50, 50, (numel,), generator=gen).to(dtype)
            data = data.to(device) if device is not None else data
            ours, theirs = data.clone(), data.clone()
            ring_all_reduce(ours, op=op, group=group)
            dist.all_reduce(theirs, op=op, group=group)
            diff = (ours.double() - theirs.double()).abs().max().item() if numel else 0.0
            rows.append({"numel": numel, "dtype": str(dtype).removeprefix("torch."), "equal": torch.equal(ours, theirs),
                         "max_abs_diff": diff})
    return rows
