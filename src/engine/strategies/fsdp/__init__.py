"""``fsdp``: fully sharded data parallel (FSDP2) of any LightningModule, its units picked by a wrap policy."""

from src.engine.strategies.fsdp.strategy import FSDPStrategy

__all__ = ["FSDPStrategy"]
