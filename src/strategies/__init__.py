"""The project's Lightning strategies: ``ddp`` (Lightning's DDP plus its fixes), ``dp``, ``pipeline`` and ``ps``.

Importing this package registers ``dp``, ``pipeline`` and ``ps`` with Lightning's ``StrategyRegistry``, so
``Trainer(strategy="dp")`` (and ``trainer.strategy=dp`` in configs) resolves them.
"""

from lightning.pytorch.strategies import StrategyRegistry

from src.strategies.ddp import DDPStrategy
from src.strategies.dp import DataParallelStrategy
from src.strategies.pipeline.strategy import PipelineStrategy
from src.strategies.ps.strategy import ParameterServerStrategy

for _strategy in (DataParallelStrategy, PipelineStrategy, ParameterServerStrategy):
    StrategyRegistry.register(_strategy.strategy_name, _strategy, description=_strategy.__doc__.splitlines()[0],
                              override=True)  # idempotent

__all__ = ["DDPStrategy", "DataParallelStrategy", "ParameterServerStrategy", "PipelineStrategy"]
