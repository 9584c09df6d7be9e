"""Every ``experiment=*`` config trains and tests for a few batches (as ashleve's test_sweeps.py); the mps trainer composes."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import hydra
import pytest
from hydra.errors import InstantiationException
from lightning.fabric.utilities.exceptions import MisconfigurationException

from src.train import train
from tests.helpers.config import CONFIG_DIR, ROOT

# ashleve's config names, kept as aliases of this template's configs (docs/coming-from.md)
ALIASES = {"experiment=example": "experiment=fashion_mnist_mlp", "model=mnist": "model=mlp",
           "trainer=ddp_sim": "trainer=ddp_spawn", "hparams_search=mnist_optuna": "hparams_search=fashion_mnist_optuna"}
EXPERIMENTS = sorted(p.stem for p in (CONFIG_DIR / "experiment").glob("*.yaml") if f"experiment={p.stem}" not in ALIASES)


@pytest.fixture(scope="module")
def cifar10_dir(tmp_path_factory) -> Path:
    """SYNTHETIC CIFAR-10 files, big enough for cifar10_resnet18's own batch of 256 after a 100-image validation split."""
    out = tmp_path_factory.mktemp("cifar")
    subprocess.run([sys.executable, str(ROOT / "scripts/make_synthetic_cifar10.py"), "--out", str(out),
                    "--per-batch", "200", "--test", "100"], check=True, capture_output=True)
    return out


def _data_overrides(name: str, request) -> list[str]:
    """Offline, CIFAR-10 comes from the synthetic files (the README's `make synthetic-cifar10`)."""
    if "cifar10" not in name:
        return []
    return [f"data.data_dir={request.getfixturevalue('cifar10_dir')}", "data.verify_checksums=false",
            "data.val_size=100", "data.batch_size=64"]  # ResNet18 on a CPU: a quarter of the batch keeps two steps short


def test_every_experiment_is_tested():
    assert EXPERIMENTS == ["cifar10_resnet18", "fashion_mnist_mlp", "toy"], "a new experiment: check it runs below"


@pytest.mark.slow
@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_runs(name, make_cfg, request):
    cfg = make_cfg("train", [f"experiment={name}", "++trainer.limit_train_batches=2", "++trainer.limit_val_batches=1",
                             "++trainer.limit_test_batches=1", *_data_overrides(name, request)])
    assert cfg.tags[0] != "dev"  # the experiment's own settings were applied
    metrics, objects = train(cfg)
    assert objects["trainer"].global_step == 2
    assert math.isfinite(float(metrics["test/loss"]))
    assert objects["trainer"].checkpoint_callback.best_model_path


@pytest.mark.fast
@pytest.mark.parametrize(("alias", "target"), ALIASES.items())
def test_ashleves_config_names_compose_as_their_targets(make_cfg, alias, target):
    from omegaconf import OmegaConf

    def composed(override: str) -> dict:
        cfg = OmegaConf.to_container(make_cfg("train", [override], subdir=override, tiny=False).copy(), resolve=False)
        cfg.pop("hydra"), cfg.pop("paths")  # paths: each its own output dir
        return cfg

    mine, theirs = composed(target), composed(alias)
    if alias == "trainer=ddp_sim":  # DDP simulated on the CPU: 2 spawned processes
        assert (theirs["trainer"].pop("accelerator"), theirs["trainer"].pop("devices")) == ("cpu", 2)
        mine["trainer"].pop("accelerator"), mine["trainer"].pop("devices")
    assert theirs == mine


@pytest.mark.fast
def test_mps_trainer_composes(make_cfg):
    cfg = make_cfg("train", ["trainer=mps"], tiny=False)
    assert (cfg.trainer.accelerator, cfg.trainer.devices) == ("mps", 1)
    assert cfg.trainer.max_epochs == 10  # inherits trainer/default.yaml
    try:
        import torch

        available = torch.backends.mps.is_available()
    except AttributeError:
        available = False
    if not available:  # no Apple GPU here: Lightning must refuse clearly, not fall back silently
        with pytest.raises(InstantiationException, match="MPS") as err:
            hydra.utils.instantiate(cfg.trainer)
        assert isinstance(err.value.__cause__, MisconfigurationException)
