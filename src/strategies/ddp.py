"""``DDPStrategy``: Lightning's DDP with the project's fixes built in, so ``Trainer(strategy=DDPStrategy())``
behaves exactly like ``trainer=ddp``:

* its launcher runs the pre-flight checks before any rank starts, and under Hydra starts each child
  rank with *this job's* command (a multirun would otherwise replay the whole sweep per rank);
* a SIGTERM reaching any rank stops every rank at the same batch, agreed every
  ``sigterm_check_every_n_batches`` batches (:mod:`src.strategies.sigterm`);
* the process group is destroyed before the interpreter exits (:mod:`src.strategies.exit_cleanup`).

Everything else (cluster environments, gradient sync, torchrun/SLURM detection) is Lightning's own.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy

from src.strategies import lightning_compat as compat
from src.strategies.exit_cleanup import destroy_default_group_at_exit
from src.strategies.sigterm import check_interval, install_sigterm_agreement


class DDPStrategy(compat.PreflightLaunch, LightningDDPStrategy):
    """Lightning's :class:`~lightning.pytorch.strategies.DDPStrategy` plus the fixes above.

    Args:
        sigterm_check_every_n_batches: how often the ranks agree on a SIGTERM (1 = every batch).
        **kwargs: Lightning's DDPStrategy arguments.
    """

    def __init__(self, *args: Any, sigterm_check_every_n_batches: int = 10, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sigterm_check_every_n_batches = check_interval(sigterm_check_every_n_batches)

    def validate(self, trainer: pl.Trainer, model: pl.LightningModule) -> None:
        """Checks this strategy adds to the pre-flight (none for plain DDP); subclasses extend it."""

    def setup_distributed(self) -> None:
        super().setup_distributed()
        destroy_default_group_at_exit()

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        install_sigterm_agreement(trainer, self.sigterm_check_every_n_batches)
