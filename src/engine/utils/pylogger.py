"""Rank-aware logging: N ranks never print N copies, and every log line says which rank wrote it."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping

# Lightning's own rank_zero_only object (lightning.pytorch re-exports it), without importing Lightning: the
# collectives room logs through this module and needs torch only
from lightning_utilities.core.rank_zero import rank_zero_only

from src.engine.runtime.launch_context import launch_context


def current_rank() -> int:
    """The global rank as Lightning knows it (set from the environment when Lightning is imported, then by the
    strategy); in a process that has not imported Lightning, the rank its launcher gave it."""
    rank = getattr(rank_zero_only, "rank", None)
    return int(rank if rank is not None else launch_context().rank or 0)


class RankFilter(logging.Filter):
    """Adds ``%(rank)s`` to every record; used by the Hydra job-logging config (``configs/hydra/default.yaml``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = current_rank()
        return True


class RankedLogger(logging.LoggerAdapter):
    """A logger that logs on rank 0 only by default, or on a chosen rank.

    ``log.info("...")`` prints once per run; ``log.info("...", rank=None)`` prints on every
    rank (each line carries its rank through :class:`RankFilter`).
    """

    def __init__(self, name: str = __name__, rank_zero_only: bool = True, extra: Mapping | None = None) -> None:
        super().__init__(logging.getLogger(name), extra)
        self.rank_zero_only = rank_zero_only

    def log(self, level: int, msg: str, *args, rank: int | None = -1, **kwargs) -> None:
        if not self.isEnabledFor(level):
            return
        target = 0 if (self.rank_zero_only and rank == -1) else rank
        if target in (None, -1) or target == current_rank():
            msg, kwargs = self.process(msg, kwargs)
            self.logger.log(level, msg, *args, **kwargs)


# Lightning's own loggers: they print its start-up lines ("Seed set to", "GPU available: ...").
LIGHTNING_LOGGERS = ("lightning.pytorch", "lightning.fabric")


@contextlib.contextmanager
def lightning_lines_held() -> Iterator[None]:
    """Hold Lightning's start-up lines while a run is built and checked: a run refused with bad input
    (:class:`~src.engine.utils.errors.UserError`, also one raised in a constructor that Hydra instantiates, or exit 2)
    prints its one error line alone, and the held lines are dropped; otherwise they are printed, in order,
    when the block ends."""
    from src.engine.utils.errors import user_error_cause

    held: list[logging.LogRecord] = []

    class Hold(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            held.append(record)

    loggers = [logging.getLogger(name) for name in LIGHTNING_LOGGERS]
    saved = [(lg, lg.handlers[:], lg.propagate) for lg in loggers]
    hold = Hold()
    for lg in loggers:
        lg.handlers, lg.propagate = [hold], False
    refused = False
    try:
        yield
    except Exception as err:  # a UserError, also inside Hydra's InstantiationException (a constructor's check)
        refused = user_error_cause(err) is not None
        raise
    except SystemExit as exit_:
        refused = exit_.code == 2
        raise
    finally:
        for lg, handlers, propagate in saved:
            lg.handlers, lg.propagate = handlers, propagate
        if not refused:
            for record in held:
                logging.getLogger(record.name).handle(record)
