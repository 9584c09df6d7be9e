"""The project's OmegaConf resolvers (``${run_uid:}``, ``${rank_zero:}``, ``${not:}``), registered whenever Hydra
starts: Hydra imports every module under ``hydra_plugins`` before it composes a config. So configs compose and
resolve the same from ``src/train.py``, from Hydra's ``compose`` API in a notebook, or in a test that never
imports this project's code (as ashleve's template's own tests do)."""

from src.engine.utils.resolvers import register_resolvers

register_resolvers()
