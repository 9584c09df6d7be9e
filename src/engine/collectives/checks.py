"""Correctness-check framework: run named checks on every rank, merge the verdicts, fail loudly.

A :class:`Check` is a module-level function (so it pickles for spawn) that launches one collective and
returns the expected and the received tensors on this rank. :func:`run_checks` runs a list of them with a
per-operation timeout, classifies backend limitations as *skipped*, then merges every rank's verdict so
all ranks agree on the outcome and can stop together.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from src.engine.collectives.runtime import (
    CollectiveError,
    backend_name,
    call_with_timeout,
    comm_device,
    first_line,
    synchronize,
    wait,
)

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"

# Substrings of backend errors meaning "this backend cannot do that", not "the result is wrong".
_UNSUPPORTED_MARKERS = ("not supported", "unsupported", "cannot use", "not implemented", "does not support")


class Unsupported(Exception):  # noqa: N818 - a verdict, not an error
    """Raised by a check to mark itself skipped (the reason is the message)."""


@dataclass
class CheckContext:
    """What a check needs: this rank's place in the world, the device, and timed waits."""

    rank: int
    world_size: int
    backend: str
    device: torch.device
    timeout_s: float
    name: str = ""
    ranks: list[int] = field(default_factory=list)  # ranks taking part; a check may narrow it (subgroups)

    def wait(self, work: Any) -> None:
        """Wait for an ``async_op=True`` handle under this check's timeout."""
        wait(work, self.timeout_s, self.name, self.backend)

    def blocking(self, fn: Callable[[], Any]) -> Any:
        """Run a call that has no async form under this check's timeout."""
        return call_with_timeout(fn, self.timeout_s, self.name)


@dataclass(frozen=True)
class Check:
    """One named correctness check. ``run(ctx)`` returns ``(expected, received)`` or None (nothing to compare
    on this rank, e.g. a non-root rank of ``reduce``); ``min_world`` skips it on smaller worlds."""

    name: str
    run: Callable[[CheckContext], tuple[torch.Tensor, torch.Tensor] | None]
    min_world: int = 1

    @property
    def collective(self) -> str:
        return self.name.split(".", 1)[0]


@dataclass
class CheckResult:
    """Verdict for one check: per rank from :func:`run_check`, or merged over ranks by :func:`merge_results`."""

    op: str
    status: str
    ranks: list[int]
    expected: str = ""
    received: str = ""
    reason: str = ""
    seconds: float = 0.0
    failed_ranks: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status != FAILED

    def describe(self) -> str:
        """One line naming the op, the ranks and expected vs received (or why it was skipped)."""
        if self.status == SKIPPED:
            return f"{self.op}: skipped ({self.reason})"
        if self.status == PASSED:
            return f"{self.op}: passed on ranks {self.ranks}"
        text = (f"{self.op}: FAILED on ranks {self.failed_ranks} of {self.ranks}: "
                f"expected {self.expected or '-'}, received {self.received or '-'}")
        return text + (f" ({self.reason})" if self.reason else "")


@dataclass
class CheckReport:
    """All verdicts of one suite run, merged across ranks."""

    backend: str
    world_size: int
    results: list[CheckResult]
    seconds: float = 0.0

    @property
    def failures(self) -> list[CheckResult]:
        return [r for r in self.results if r.status == FAILED]

    @property
    def skipped(self) -> list[CheckResult]:
        return [r for r in self.results if r.status == SKIPPED]

    @property
    def passed(self) -> list[CheckResult]:
        return [r for r in self.results if r.status == PASSED]

    def counts(self) -> dict[str, int]:
        return {PASSED: len(self.passed), FAILED: len(self.failures), SKIPPED: len(self.skipped)}

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "world_size": self.world_size, "seconds": self.seconds,
                "counts": self.counts(), "results": [{**asdict(r), "ok": r.ok} for r in self.results]}

    def raise_if_failed(self) -> None:
        """Raise :class:`CollectiveError` listing every failed op with its ranks and expected vs received."""
        if self.failures:
            lines = "\n  ".join(r.describe() for r in self.failures)
            raise CollectiveError(f"{len(self.failures)} collective check(s) failed on {self.backend} "
                                  f"(world size {self.world_size}):\n  {lines}")


def summarize(t: torch.Tensor | None, limit: int = 6) -> str:
    """Short text of a tensor's leading values, dtype and length, for messages and reports."""
    if t is None:
        return "-"
    flat = t.detach().reshape(-1).cpu()
    values = ", ".join(_fmt(v) for v in flat[:limit].tolist())
    more = ", ..." if flat.numel() > limit else ""
    return f"[{values}{more}] ({str(t.dtype).removeprefix('torch.')}, n={flat.numel()})"


def _fmt(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def matches(expected: torch.Tensor, received: torch.Tensor) -> bool:
    """Exact for integers/bools, tight tolerance for floats (AVG divides)."""
    received = received.detach().cpu()
    expected = expected.detach().cpu()
    if expected.shape != received.shape or expected.dtype != received.dtype:
        return False
    if expected.is_floating_point():
        return torch.allclose(expected, received, rtol=1e-6, atol=1e-6)
    return torch.equal(expected, received)


def is_unsupported(err: BaseException) -> bool:
    """True for backend errors that mean "this op/dtype is not available here"."""
    text = str(err).lower()
    return isinstance(err, Unsupported | NotImplementedError) or any(m in text for m in _UNSUPPORTED_MARKERS)


def make_context(timeout_s: float) -> CheckContext:
    """Context for the default (world) group of this process."""
    return CheckContext(rank=dist.get_rank(), world_size=dist.get_world_size(), backend=backend_name(),
                        device=comm_device(), timeout_s=timeout_s)


def run_check(check: Check, ctx: CheckContext) -> CheckResult:
    """Run one check on this rank. Timeouts and broken waits propagate (the group is unusable afterwards);
    errors raised when launching become a skipped (backend limitation) or failed verdict."""
    ctx.name, ctx.ranks = check.name, list(range(ctx.world_size))
    if ctx.world_size < check.min_world:
        return CheckResult(check.name, SKIPPED, ctx.ranks, reason=f"needs at least {check.min_world} ranks")
    start = time.perf_counter()
    try:
        outcome = check.run(ctx)
        synchronize(ctx.device)
    except CollectiveError:  # timed out or broke the group: later checks cannot run
        raise
    except Exception as err:  # classify: backend limitation -> skipped, anything else -> failed
        message = first_line(err)
        if is_unsupported(err):
            return CheckResult(check.name, SKIPPED, ctx.ranks, reason=f"unsupported by {ctx.backend}: {message}")
        return CheckResult(check.name, FAILED, ctx.ranks, reason=f"raised {type(err).__name__}: {message}",
                           failed_ranks=[ctx.rank], seconds=time.perf_counter() - start)
    result = CheckResult(check.name, PASSED, list(ctx.ranks), seconds=time.perf_counter() - start)
    if outcome is not None:
        expected, received = outcome
        result.expected, result.received = summarize(expected), summarize(received)
        if not matches(expected, received):
            result.status, result.failed_ranks = FAILED, [ctx.rank]
    return result


def merge_results(per_rank: Sequence[Sequence[CheckResult]]) -> list[CheckResult]:
    """Fold every rank's verdicts into one per op: failed if any rank failed, skipped if every rank skipped."""
    merged: dict[str, CheckResult] = {}
    for results in per_rank:
        for res in results:
            cur = merged.get(res.op)
            if cur is None:
                merged[res.op] = CheckResult(**{**asdict(res), "failed_ranks": list(res.failed_ranks)})
                continue
            cur.seconds = max(cur.seconds, res.seconds)
            cur.ranks = sorted(set(cur.ranks) | set(res.ranks))
            cur.failed_ranks = sorted(set(cur.failed_ranks) | set(res.failed_ranks))
            if res.status == FAILED and cur.status != FAILED:
                cur.status, cur.expected, cur.received, cur.reason = FAILED, res.expected, res.received, res.reason
            elif cur.status == SKIPPED and res.status == PASSED:
                cur.status, cur.reason = PASSED, ""
            if not cur.expected and res.expected:  # ranks without a result (non-root) report nothing
                cur.expected, cur.received = res.expected, res.received
    return list(merged.values())


def select_checks(checks: Iterable[Check], only: Sequence[str] | None) -> list[Check]:
    """Checks whose name or collective matches one of ``only`` (exact name, collective, or name prefix)."""
    checks = list(checks)
    if not only:
        return checks
    wanted = [str(o) for o in only]
    chosen = [c for c in checks if any(c.name == w or c.collective == w or c.name.startswith(w + ".") for w in wanted)]
    unknown = [w for w in wanted if not any(c.name == w or c.collective == w or c.name.startswith(w + ".")
                                            for c in checks)]
    if unknown:
        raise ValueError(f"unknown collective check(s) {unknown}; known: {sorted({c.collective for c in checks})}")
    return chosen


def run_checks(
    checks: Iterable[Check],
    *,
    only: Sequence[str] | None = None,
    extra_checks: Iterable[Check] = (),
    timeout_s: float = 60.0,
    gather: bool = True,
) -> CheckReport:
    """Run ``checks`` on the default process group; every rank must call it with the same arguments.

    ``checks`` are filtered by ``only``; ``extra_checks`` are appended. With ``gather`` every rank receives
    the merged report (one object all-gather); otherwise the report holds this rank's own verdicts. A
    timeout raises :class:`CollectiveTimeoutError` at once. The built-in suite is
    :func:`src.engine.collectives.suite.run_suite`.
    """
    chosen = select_checks(checks, only) + list(extra_checks)
    ctx = make_context(timeout_s)
    start = time.perf_counter()
    local = [run_check(check, ctx) for check in chosen]
    if gather and ctx.world_size > 1:
        gathered: list[Any] = [None] * ctx.world_size
        call_with_timeout(lambda: dist.all_gather_object(gathered, local), timeout_s, "all_gather_object(report)")
        results = merge_results(gathered)
    else:
        results = merge_results([local])
    return CheckReport(ctx.backend, ctx.world_size, results, seconds=time.perf_counter() - start)
