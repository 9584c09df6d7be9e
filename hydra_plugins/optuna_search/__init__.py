"""The Hydra sweeper of ``hydra/sweeper=optuna``: Optuna search with pruning and parallel trials.

Hydra builds a sweeper only from a class defined under ``hydra_plugins`` that its plugin scan found
(``hydra.core.plugins.Plugins._instantiate`` refuses any other ``_target_``), so this class lives here.
Hydra imports every plugin module at start-up, in every run, so this one imports nothing heavy: the search
itself, and Optuna, load only when a sweep starts (``src/engine/search/sweeper.py``).
"""

from __future__ import annotations

from typing import Any

from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig


class OptunaSearchSweeper(Sweeper):
    """Hydra's side of the search; the settings are read from ``hydra.sweeper`` in :meth:`sweep`."""

    def __init__(self, **settings: Any) -> None:
        self.config: DictConfig | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: list[str]) -> None:
        try:
            from src.engine.search.sweeper import OptunaSearch
        except ImportError as err:
            from src.engine.utils.errors import ConfigError

            raise ConfigError(f"an Optuna search needs optuna ({err}); fix: pip install -e '.[sweep]'") from None
        OptunaSearch(self.config, self.launcher).sweep(arguments)
