"""Per-rank randomness: the ranks of a DDP run start from equal weights but draw their own dropout masks and augmentations.

Every rank is seeded alike (so replicas start equal) and Lightning's DDP strategy re-applies that seed.
Without a per-rank stream, two ranks would drop the same units and crop the same way on different data.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning import Callback, LightningModule, Trainer
from torch import nn

from src.data.mnist_datamodule import FashionMNISTDataModule
from tests.helpers.entry import run_entry
from tests.helpers.run_if import requires_2_gpus


def _cpu_state(net: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in net.state_dict().items()}


class RecordRandomness(Callback):
    """Test-only: every rank saves its initial and final weights, its first dropout mask and an augmented fixed batch."""

    def __init__(self, dirpath: str) -> None:
        self.dirpath = Path(dirpath)
        self.record: dict[str, object] = {}
        self.hook = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":  # before DDP wraps the module and broadcasts rank 0's weights
            self.record["initial"] = _cpu_state(pl_module.net)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        if batch_idx != 0:
            return
        images = torch.randint(0, 256, (32, 1, 28, 28), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
        augmented = trainer.datamodule.transform_batch(images.to(pl_module.device), training=True)
        self.record["augmented"] = augmented.cpu()
        dropout = next(m for m in pl_module.net.modules() if isinstance(m, nn.Dropout))
        self.hook = dropout.register_forward_hook(self.record_mask)

    def record_mask(self, module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        self.record["active"] = (inputs[0] != 0).cpu()  # units the mask could act on
        self.record["kept"] = (output != 0).cpu()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        if self.hook is not None:
            self.hook.remove()
            self.hook = None

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.record["final"] = _cpu_state(pl_module.net)
        self.dirpath.mkdir(parents=True, exist_ok=True)
        torch.save(self.record, self.dirpath / f"rank{trainer.global_rank}.pt")


def ddp_records(tmp_path: Path, accelerator: str) -> tuple[dict, dict]:
    """A real `python src/train.py trainer=ddp trainer.devices=2` run (2 training steps); each rank's records."""
    proc = run_entry(
        "train", "trainer=ddp", "trainer.devices=2", f"trainer.accelerator={accelerator}", "data.augment=true",
        "model.net.dropout=0.1", "trainer.max_epochs=1", "++trainer.limit_train_batches=2",
        "++trainer.limit_val_batches=1", "test=false", "callbacks=none", "logger=none", "extras.print_config=false",
        "+callbacks.randomness._target_=tests.test_randomness.RecordRandomness",
        f"+callbacks.randomness.dirpath={tmp_path}/records", f"hydra.run.dir={tmp_path}/run", timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r0, r1 = (torch.load(tmp_path / "records" / f"rank{r}.pt") for r in (0, 1))
    return r0, r1


def assert_per_rank_streams(r0: dict, r1: dict) -> None:
    for name, value in r0["initial"].items():  # the same initial weights on every rank ...
        assert torch.equal(value, r1["initial"][name]), f"initial {name} differs between ranks"
    for name, value in r0["final"].items():  # ... and DDP keeps the replicas identical
        assert torch.equal(value, r1["final"][name]), f"final {name} differs between ranks"
    both = r0["active"] & r1["active"]
    assert int(both.sum()) > 1000
    # p=0.1: independent masks disagree on 2p(1-p) = 18% of the units both ranks pass on; a shared stream on none.
    disagree = (r0["kept"] != r1["kept"])[both].float().mean().item()
    assert disagree > 0.05, f"dropout masks agree on {1 - disagree:.1%} of units: one stream for both ranks"
    assert not torch.equal(r0["augmented"], r1["augmented"]), "both ranks cropped and flipped alike"


@pytest.mark.slow
def test_ddp_ranks_draw_their_own_dropout_and_augmentation(tmp_path):
    assert_per_rank_streams(*ddp_records(tmp_path, "cpu"))


@pytest.mark.gpu
@requires_2_gpus
def test_ddp_ranks_draw_their_own_dropout_and_augmentation_on_2_gpus(tmp_path):
    assert_per_rank_streams(*ddp_records(tmp_path, "gpu"))


@pytest.mark.fast
def test_augmentation_stream_depends_on_rank_and_seed_only():
    images = torch.randint(0, 256, (64, 1, 28, 28), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))

    def augment(rank: int, seed: int = 12345) -> torch.Tensor:
        dm = FashionMNISTDataModule(augment=True, seed=seed)
        dm.trainer = SimpleNamespace(global_rank=rank)
        torch.manual_seed(0)  # the global stream plays no part
        return dm.transform_batch(images, training=True)

    assert torch.equal(augment(0), augment(0)) and torch.equal(augment(1), augment(1))  # reproducible
    assert not torch.equal(augment(0), augment(1))
    assert not torch.equal(augment(0), augment(0, seed=1))
