"""Rank-aware logging: N ranks never print N copies, and every log line says which rank wrote it."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from lightning.pytorch.utilities.rank_zero import rank_zero_only


def current_rank() -> int:
    """The global rank as Lightning knows it (set from the environment, then by the strategy)."""
    return int(getattr(rank_zero_only, "rank", 0) or 0)


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
