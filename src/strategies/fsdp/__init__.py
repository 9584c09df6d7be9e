"""``fsdp``: fully sharded data parallel (FSDP2) over ``model.net``'s named blocks."""

from src.strategies.fsdp.strategy import FSDPStrategy

__all__ = ["FSDPStrategy"]
