"""``dp``: single-process data parallelism; the strategy and its shard runner."""

from src.engine.strategies.dp.strategy import DataParallelStrategy

__all__ = ["DataParallelStrategy"]
