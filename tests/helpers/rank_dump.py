"""A test-only callback: every rank saves its parameters at the end of fit, to compare replicas across processes."""

from __future__ import annotations

from pathlib import Path

import torch
from lightning import Callback, LightningModule, Trainer


class SaveRankParams(Callback):
    """Writes ``<dirpath>/params_rank<R>.pt`` (state dict of ``pl_module.net``) on every rank."""

    def __init__(self, dirpath: str) -> None:
        self.dirpath = Path(dirpath)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.dirpath.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().cpu().clone() for k, v in pl_module.net.state_dict().items()}
        torch.save(state, self.dirpath / f"params_rank{trainer.global_rank}.pt")
