"""Project strategies. Importing this package registers them with Lightning's ``StrategyRegistry``,
so ``Trainer(strategy="<name>")`` (and ``trainer.strategy=<name>`` in configs) resolves them."""

from lightning.pytorch.strategies import StrategyRegistry

from src.strategies.dp import DataParallelStrategy
from src.strategies.pipeline.strategy import PipelineStrategy


def register_strategies() -> None:
    """Add the project's strategies to Lightning's registry (idempotent)."""
    for strategy_cls in (DataParallelStrategy, PipelineStrategy):
        strategy_cls.register_strategies(StrategyRegistry)


register_strategies()
