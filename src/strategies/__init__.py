"""The project's Lightning strategies: ``ddp`` (Lightning's DDP plus its fixes), ``fsdp`` (FSDP2 with the same
fixes), ``dp`` and ``pipeline``.

Importing this package registers ``dp`` and ``pipeline`` with Lightning's ``StrategyRegistry``, so
``Trainer(strategy="dp")`` (and ``trainer.strategy=dp`` in configs) resolves them. ``fsdp`` is not
registered: Lightning's registry keeps that name for its own FSDP1 strategy; use ``trainer=fsdp``.
"""

from lightning.pytorch.strategies import StrategyRegistry

from src.strategies.ddp import DDPStrategy
from src.strategies.dp import DataParallelStrategy
from src.strategies.fsdp import FSDPStrategy
from src.strategies.pipeline.strategy import PipelineStrategy

for _strategy in (DataParallelStrategy, PipelineStrategy):
    StrategyRegistry.register(_strategy.strategy_name, _strategy, description=_strategy.__doc__.splitlines()[0],
                              override=True)  # idempotent

__all__ = ["DDPStrategy", "DataParallelStrategy", "FSDPStrategy", "PipelineStrategy"]
