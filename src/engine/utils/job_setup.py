"""Hydra callbacks that prepare each job's process before the task runs: keys from ``.env``, and quiet libraries."""

from __future__ import annotations

import logging
import os
import re
import warnings
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

# Warnings raised inside the pinned libraries about their own code: nothing a user of this template can act on.
# (message prefix, category, module that triggers it). Warnings about the user's config are left alone.
LIBRARY_WARNINGS = (
    # torch 2.10 deprecated LeafSpec; Lightning 2.6's CombinedLoader still builds one per loader
    ("`isinstance(treespec, LeafSpec)` is deprecated", FutureWarning, "lightning.pytorch.utilities._pytree"),
)
# Lightning's advertisement for its cloud logger, printed by every Trainer(...)
LIGHTNING_TIP = "💡 Tip:"


class LoadDotenv(Callback):
    """Load ``KEY=value`` lines from ``path`` (default: ``.env`` at the project root) into the environment.

    For logger keys (``WANDB_API_KEY``, ``MLFLOW_TRACKING_URI``...) that must never be committed: copy
    ``.env.example`` to ``.env`` (git-ignored). Variables already set in the shell win.
    """

    def __init__(self, path: str | None = None) -> None:
        self.path = Path(path) if path else Path(os.environ.get("PROJECT_ROOT", ".")) / ".env"

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if self.path.is_file():
            from dotenv import load_dotenv

            load_dotenv(self.path, override=False)


class QuietLibraries(Callback):
    """Filter :data:`LIBRARY_WARNINGS` and Lightning's tip, in this process and in ranks it spawns.

    Spawned ranks (``ddp_spawn``) start a fresh interpreter that runs no Hydra callback, so the
    filters also go into ``PYTHONWARNINGS``, which every new interpreter reads at start.
    """

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        specs = []
        for message, category, module in LIBRARY_WARNINGS:
            warnings.filterwarnings("ignore", re.escape(message), category, re.escape(module))
            specs.append(f"ignore:{message.split(',')[0]}:{category.__name__}:{module}")
        current = os.environ.get("PYTHONWARNINGS")
        os.environ["PYTHONWARNINGS"] = ",".join(s for s in [current, *specs] if s and s not in (current or ""))
        logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_drop_lightning_tip)


def _drop_lightning_tip(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(LIGHTNING_TIP)
