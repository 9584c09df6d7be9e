"""The built-in correctness checks: every point-to-point call, collective and ReduceOp, each compared with
a closed-form expected result.

Inputs are rank-dependent so a dropped, duplicated or misplaced contribution changes the result. With
``n`` ranks and ``v_r[i] = (r + 1)(i + 1)`` (``i < n + 3``):

* all_reduce/reduce SUM = ``(i + 1) n (n + 1) / 2``; AVG = ``(i + 1)(n + 1) / 2``; MIN = ``i + 1``;
  MAX = ``(i + 1) n``; PRODUCT (rank ``r`` contributes ``r + 1`` at positions ``i % n == r``, else 1)
  = ``i % n + 1``; bitwise ops on int64 use one private bit per rank plus shared high bits;
* broadcast delivers the source's ``v``; scatter delivers chunk ``r`` to rank ``r``; gather/all_gather
  concatenate every ``v_j``; reduce_scatter leaves rank ``r`` the sum of every rank's chunk ``r``;
  all_to_all transposes (rank ``r`` receives chunk ``r`` of every rank, in rank order);
* subgroups (``new_group`` of the even and the odd ranks) reduce/gather over their members only.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence

import torch
import torch.distributed as dist

from src.engine.collectives.checks import Check, CheckContext, CheckReport, run_checks
from src.engine.collectives.runtime import all_gather_tensor, reduce_scatter_tensor

Outcome = tuple[torch.Tensor, torch.Tensor] | None

BITWISE_OPS = ("BAND", "BOR", "BXOR")
_DTYPES = {"float32": torch.float32, "float64": torch.float64, "int64": torch.int64}
_BIT_SHIFT = 48  # rank bits below, shared position bits above


def _length(n: int) -> int:
    return n + 3


def _values(rank: int, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``v_r[i] = (r + 1)(i + 1)``: the standard rank-dependent input."""
    return (torch.arange(_length(n), device=device) + 1).mul(rank + 1).to(dtype)


def _all_values(n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.cat([_values(r, n, dtype, torch.device("cpu")) for r in range(n)])


# ---------------------------------------------------------------- reductions (inputs and closed forms)

def reduction_input(op: str, rank: int, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """This rank's input for a reduction check of ``op``."""
    i = torch.arange(_length(n), device=device)
    if op == "PRODUCT":
        return torch.where(i % n == rank, rank + 1, 1).to(dtype)
    if op in BITWISE_OPS:
        return ((i << _BIT_SHIFT) | (1 << (rank % _BIT_SHIFT))).to(dtype)
    return _values(rank, n, dtype, device)


def reduction_expected(op: str, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Closed-form result of reducing every rank's :func:`reduction_input` with ``op``."""
    i = torch.arange(_length(n), dtype=torch.float64)
    if op == "SUM":
        out = (i + 1) * (n * (n + 1) / 2)
    elif op == "AVG":
        out = (i + 1) * ((n + 1) / 2)
    elif op == "MIN":
        out = i + 1
    elif op == "MAX":
        out = (i + 1) * n
    elif op == "PRODUCT":
        out = i.remainder(n) + 1
    elif op in BITWISE_OPS:
        rank_bits = [1 << (r % _BIT_SHIFT) for r in range(n)]
        fold = {"BAND": operator.and_, "BOR": operator.or_, "BXOR": operator.xor}[op]
        low = functools.reduce(fold, rank_bits)
        high = {"BAND": True, "BOR": True, "BXOR": n % 2 == 1}[op]  # shared bits survive unless XOR-ed evenly
        ii = torch.arange(_length(n), dtype=torch.int64)
        return ((ii << _BIT_SHIFT) * int(high) | low).to(dtype)
    else:
        raise ValueError(f"no closed form for ReduceOp {op}")
    return out.to(dtype)


def _all_reduce(op: str, dtype_name: str, ctx: CheckContext) -> Outcome:
    dtype = _DTYPES[dtype_name]
    t = reduction_input(op, ctx.rank, ctx.world_size, dtype, ctx.device)
    ctx.wait(dist.all_reduce(t, op=getattr(dist.ReduceOp, op), async_op=True))
    return reduction_expected(op, ctx.world_size, dtype), t


def _reduce(op: str, dtype_name: str, ctx: CheckContext) -> Outcome:
    dtype = _DTYPES[dtype_name]
    t = reduction_input(op, ctx.rank, ctx.world_size, dtype, ctx.device)
    ctx.wait(dist.reduce(t, dst=0, op=getattr(dist.ReduceOp, op), async_op=True))
    return (reduction_expected(op, ctx.world_size, dtype), t) if ctx.rank == 0 else None


def _reduction_cases() -> list[tuple[str, str]]:
    cases = [(op, dt) for op in ("SUM", "PRODUCT", "MIN", "MAX") for dt in ("float32", "int64")]
    cases += [("AVG", "float32"), ("AVG", "float64")]  # AVG of integers is not an integer
    cases += [(op, "int64") for op in BITWISE_OPS]  # bitwise ops are defined on integers only
    return cases


# ---------------------------------------------------------------- point-to-point

def _send_recv(ctx: CheckContext) -> Outcome:
    """Blocking ring shift: rank 0 sends first, every other rank receives first, so nobody deadlocks."""
    n, r = ctx.world_size, ctx.rank
    mine, got = _values(r, n, torch.float32, ctx.device), torch.empty(_length(n), device=ctx.device)

    def shift() -> None:
        if r == 0:
            dist.send(mine, dst=(r + 1) % n)
            dist.recv(got, src=(r - 1) % n)
        else:
            dist.recv(got, src=(r - 1) % n)
            dist.send(mine, dst=(r + 1) % n)

    ctx.blocking(shift)
    return _values((r - 1) % n, n, torch.float32, torch.device("cpu")), got


def _isend_irecv(ctx: CheckContext) -> Outcome:
    """Non-blocking ring shift: post both, then wait.

    Even ranks post the send first, odd ranks the receive. nccl runs a rank's point-to-point calls in
    order on one stream, so if every rank posted its receive first, every rank would wait forever.
    """
    n, r = ctx.world_size, ctx.rank
    mine, got = _values(r, n, torch.float32, ctx.device), torch.empty(_length(n), device=ctx.device)
    post_send = functools.partial(dist.isend, mine, dst=(r + 1) % n)
    post_recv = functools.partial(dist.irecv, got, src=(r - 1) % n)
    if r % 2 == 0:
        send, recv = post_send(), post_recv()
    else:
        recv, send = post_recv(), post_send()
    ctx.wait(send)
    ctx.wait(recv)
    return _values((r - 1) % n, n, torch.float32, torch.device("cpu")), got


def _batch_isend_irecv(ctx: CheckContext) -> Outcome:
    """Both directions at once: receive the left and the right neighbour's values in one batch."""
    n, r = ctx.world_size, ctx.rank
    left, right = (r - 1) % n, (r + 1) % n
    mine = _values(r, n, torch.float32, ctx.device)
    from_left, from_right = (torch.empty(_length(n), device=ctx.device) for _ in range(2))
    ops = [dist.P2POp(dist.isend, mine, right, tag=0), dist.P2POp(dist.isend, mine, left, tag=1),
           dist.P2POp(dist.irecv, from_left, left, tag=0), dist.P2POp(dist.irecv, from_right, right, tag=1)]
    for work in dist.batch_isend_irecv(ops):
        ctx.wait(work)
    cpu = torch.device("cpu")
    expected = torch.cat([_values(left, n, torch.float32, cpu), _values(right, n, torch.float32, cpu)])
    return expected, torch.cat([from_left, from_right])


# ---------------------------------------------------------------- data movement collectives

def _broadcast(ctx: CheckContext) -> Outcome:
    src = ctx.world_size - 1  # not rank 0, so a "rank 0 wins" bug shows
    t = _values(ctx.rank, ctx.world_size, torch.float32, ctx.device)
    ctx.wait(dist.broadcast(t, src=src, async_op=True))
    return _values(src, ctx.world_size, torch.float32, torch.device("cpu")), t


def _chunk(owner: int, k: int, n: int, device: torch.device) -> torch.Tensor:
    """Chunk ``k`` of rank ``owner``'s list: distinct per (owner, k) so misplaced chunks show."""
    return (owner * n + k) * 10 + torch.arange(2, dtype=torch.float32, device=device)


def _scatter(ctx: CheckContext) -> Outcome:
    n, r = ctx.world_size, ctx.rank
    out = torch.empty(2, device=ctx.device)
    chunks = [_chunk(0, k, n, ctx.device) for k in range(n)] if r == 0 else None
    ctx.wait(dist.scatter(out, chunks, src=0, async_op=True))
    return _chunk(0, r, n, torch.device("cpu")), out


def _gather(ctx: CheckContext) -> Outcome:
    n, r = ctx.world_size, ctx.rank
    out = [torch.empty(_length(n), device=ctx.device) for _ in range(n)] if r == 0 else None
    ctx.wait(dist.gather(_values(r, n, torch.float32, ctx.device), out, dst=0, async_op=True))
    return (_all_values(n, torch.float32), torch.cat(out)) if r == 0 else None


def _all_gather(ctx: CheckContext) -> Outcome:
    n, r = ctx.world_size, ctx.rank
    out = [torch.empty(_length(n), device=ctx.device) for _ in range(n)]
    ctx.wait(dist.all_gather(out, _values(r, n, torch.float32, ctx.device), async_op=True))
    return _all_values(n, torch.float32), torch.cat(out)


def _all_gather_tensor(ctx: CheckContext) -> Outcome:
    n, r = ctx.world_size, ctx.rank
    out = torch.empty(n * _length(n), device=ctx.device)
    ctx.wait(all_gather_tensor(out, _values(r, n, torch.float32, ctx.device), async_op=True))
    return _all_values(n, torch.float32), out


def _rs_chunk(owner: int, k: int, n: int, device: torch.device) -> torch.Tensor:
    """Rank ``owner``'s contribution to chunk ``k`` of a reduce_scatter: ``(owner + 1)(k L + j + 1)``."""
    length = _length(n)
    return (owner + 1) * (k * length + torch.arange(length, dtype=torch.float32, device=device) + 1)


def _rs_expected(r: int, n: int) -> torch.Tensor:
    length = _length(n)
    return (n * (n + 1) / 2) * (r * length + torch.arange(length, dtype=torch.float32) + 1)


def _reduce_scatter(ctx: CheckContext) -> Outcome:
    n, r = ctx.world_size, ctx.rank
    out = torch.empty(_length(n), device=ctx.device)
    ctx.wait(dist.reduce_scatter(out, [_rs_chunk(r, k, n, ctx.device) for k in range(n)], async_op=True))
    return _rs_expected(r, n), out


def _reduce_scatter_tensor(ctx: CheckContext) -> Outcome:
    n, r = ctx.world_size, ctx.rank
    out = torch.empty(_length(n), device=ctx.device)
    inp = torch.cat([_rs_chunk(r, k, n, ctx.device) for k in range(n)])
    ctx.wait(reduce_scatter_tensor(out, inp, async_op=True))
    return _rs_expected(r, n), out


def _a2a_expected(r: int, n: int) -> torch.Tensor:
    return torch.cat([_chunk(i, r, n, torch.device("cpu")) for i in range(n)])


def _all_to_all(ctx: CheckContext) -> Outcome:
    n, r = ctx.world_size, ctx.rank
    out = [torch.empty(2, device=ctx.device) for _ in range(n)]
    ctx.wait(dist.all_to_all(out, [_chunk(r, k, n, ctx.device) for k in range(n)], async_op=True))
    return _a2a_expected(r, n), torch.cat(out)


def _all_to_all_single(ctx: CheckContext) -> Outcome:
    n, r = ctx.world_size, ctx.rank
    out = torch.empty(2 * n, device=ctx.device)
    inp = torch.cat([_chunk(r, k, n, ctx.device) for k in range(n)])
    ctx.wait(dist.all_to_all_single(out, inp, async_op=True))
    return _a2a_expected(r, n), out


def _barrier(ctx: CheckContext) -> Outcome:
    ctx.wait(dist.barrier(async_op=True))
    return None


# ---------------------------------------------------------------- subgroups

def _parity_groups(ctx: CheckContext) -> tuple[list[int], dist.ProcessGroup, list[dist.ProcessGroup]]:
    """``new_group`` of the even and of the odd ranks. Every rank must create every group, in the same order."""
    even, odd = list(range(0, ctx.world_size, 2)), list(range(1, ctx.world_size, 2))
    created = [ctx.blocking(lambda ranks=ranks: dist.new_group(ranks)) for ranks in (even, odd) if ranks]
    members = even if ctx.rank % 2 == 0 else odd
    return members, created[ctx.rank % 2], created


def _destroy(groups: Sequence[dist.ProcessGroup]) -> None:
    for g in groups:
        if g not in (None, dist.GroupMember.NON_GROUP_MEMBER):
            dist.destroy_process_group(g)


def _new_group_all_reduce(ctx: CheckContext) -> Outcome:
    members, group, created = _parity_groups(ctx)
    ctx.ranks = members
    n = ctx.world_size
    t = _values(ctx.rank, n, torch.float32, ctx.device)
    try:
        ctx.wait(dist.all_reduce(t, group=group, async_op=True))
    finally:
        _destroy(created)
    expected = (torch.arange(_length(n), dtype=torch.float32) + 1) * sum(m + 1 for m in members)
    return expected, t


def _new_group_all_gather(ctx: CheckContext) -> Outcome:
    members, group, created = _parity_groups(ctx)
    ctx.ranks = members
    n = ctx.world_size
    out = [torch.empty(_length(n), device=ctx.device) for _ in members]
    try:
        ctx.wait(dist.all_gather(out, _values(ctx.rank, n, torch.float32, ctx.device), group=group, async_op=True))
    finally:
        _destroy(created)
    expected = torch.cat([_values(m, n, torch.float32, torch.device("cpu")) for m in members])
    return expected, torch.cat(out)


# ---------------------------------------------------------------- the suite

def _build() -> list[Check]:
    checks = [
        Check("send_recv", _send_recv, min_world=2),
        Check("isend_irecv", _isend_irecv, min_world=2),
        Check("batch_isend_irecv", _batch_isend_irecv, min_world=2),
        Check("broadcast", _broadcast),
    ]
    for op, dt in _reduction_cases():
        checks.append(Check(f"reduce.{op}.{dt}", functools.partial(_reduce, op, dt)))
    for op, dt in _reduction_cases():
        checks.append(Check(f"all_reduce.{op}.{dt}", functools.partial(_all_reduce, op, dt)))
    checks += [
        Check("scatter", _scatter),
        Check("gather", _gather),
        Check("all_gather", _all_gather),
        Check(all_gather_tensor.__name__, _all_gather_tensor),
        Check("reduce_scatter", _reduce_scatter),
        Check(reduce_scatter_tensor.__name__, _reduce_scatter_tensor),
        Check("all_to_all", _all_to_all),
        Check("all_to_all_single", _all_to_all_single),
        Check("barrier", _barrier),
        Check("new_group.all_reduce", _new_group_all_reduce),
        Check("new_group.all_gather", _new_group_all_gather),
    ]
    return checks


ALL_CHECKS: list[Check] = _build()
"""Every built-in check, in run order (point-to-point first, subgroups last)."""

CHECK_NAMES: list[str] = [c.name for c in ALL_CHECKS]


def run_suite(
    *,
    only: Sequence[str] | None = None,
    extra_checks: Sequence[Check] = (),
    timeout_s: float = 60.0,
    gather: bool = True,
) -> CheckReport:
    """Run the built-in checks (:data:`ALL_CHECKS`, filtered by ``only``) plus ``extra_checks``; see
    :func:`~src.engine.collectives.checks.run_checks`."""
    return run_checks(ALL_CHECKS, only=only, extra_checks=extra_checks, timeout_s=timeout_s, gather=gather)
