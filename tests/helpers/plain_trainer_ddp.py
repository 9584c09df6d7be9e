"""A user's own script: ``Trainer(strategy=DDPStrategy())`` with no Hydra and no ``src/train.py``.

Started once per node by ``tests/test_sigterm_check.py`` (NODE_RANK/MASTER_* in the environment).
Prints ``TRAINING`` once training is under way and ``STOP rank=.. epoch=.. step=..`` where it stops.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from src.engine.strategies.ddp import DDPStrategy  # noqa: E402


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        time.sleep(0.01)  # a slow step, so the signal lands mid-epoch
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Report(L.Callback):
    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == 5:
            print("TRAINING", flush=True)

    def on_exception(self, trainer, module, exception):
        print(f"STOP rank={trainer.global_rank} epoch={trainer.current_epoch} step={trainer.global_step}", flush=True)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    every_n = int(sys.argv[1])
    data = TensorDataset(torch.randn(256, 4), torch.randn(256, 1))
    trainer = L.Trainer(strategy=DDPStrategy(sigterm_check_every_n_batches=every_n), accelerator="cpu", devices=1,
                        num_nodes=2, max_epochs=1000, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[Report()])
    trainer.fit(Tiny(), DataLoader(data, batch_size=8))
