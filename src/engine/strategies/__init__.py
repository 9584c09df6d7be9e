"""The project's Lightning strategies: ``single_device`` and ``ddp`` (Lightning's, plus the project's fixes),
``fsdp`` (FSDP2 with the same fixes), ``dp``, ``pipeline`` and ``ps`` (parameter servers); ``launchers`` is how
the multi-process ones start their ranks, ``process_life`` what ddp and fsdp share, ``global_batch`` how a
global batch splits over each strategy's replicas, ``options`` which strategy takes an option.

Importing this package registers ``dp``, ``pipeline`` and ``ps`` with Lightning's ``StrategyRegistry``, so
``Trainer(strategy="dp")`` (and ``trainer.strategy=dp`` in configs) resolves them. ``fsdp`` is not
registered: Lightning's registry keeps that name for its own FSDP1 strategy; use ``trainer=fsdp``.
"""

from lightning.pytorch.strategies import StrategyRegistry

from src.engine.strategies.ddp import DDPStrategy
from src.engine.strategies.dp import DataParallelStrategy
from src.engine.strategies.fsdp import FSDPStrategy
from src.engine.strategies.pipeline.strategy import PipelineStrategy
from src.engine.strategies.ps.strategy import ParameterServerStrategy
from src.engine.strategies.single_device import SingleDeviceStrategy

for _strategy in (DataParallelStrategy, PipelineStrategy, ParameterServerStrategy):
    StrategyRegistry.register(_strategy.strategy_name, _strategy, description=_strategy.__doc__.splitlines()[0],
                              override=True)  # idempotent

__all__ = ["DDPStrategy", "DataParallelStrategy", "FSDPStrategy", "ParameterServerStrategy", "PipelineStrategy",
           "SingleDeviceStrategy"]
