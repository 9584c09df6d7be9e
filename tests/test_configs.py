"""Every option of every config group composes, and builds the objects it names."""

from __future__ import annotations

import importlib.util
import re

import hydra
import pytest
from lightning import Callback
from lightning.pytorch.loggers import Logger
from omegaconf import OmegaConf

import src.engine.strategies  # noqa: F401  (registers the dp and pipeline names)
from src.engine.checkpointing.io import AtomicCheckpointIO
from src.engine.utils.instantiators import instantiate_callbacks, instantiate_loggers
from tests.helpers.config import CONFIG_DIR, ROOT

pytestmark = pytest.mark.fast


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


# model -> a data option it pairs with
PAIRS = {"mnist": "fashion_mnist", "mlp": "fashion_mnist", "resnet18": "cifar10", "toy": "toy"}
OPTIONAL_PACKAGES = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}


@pytest.mark.parametrize("data", options("data"))
def test_data_options_instantiate(make_cfg, data):
    model = {"toy": "toy"}.get(data, "mlp")
    cfg = make_cfg("train", [f"data={data}", f"model={model}"])
    dm = hydra.utils.instantiate(cfg.data)
    assert dm.hparams.batch_size == cfg.data.batch_size


@pytest.mark.parametrize("model", options("model"))
def test_model_options_instantiate(make_cfg, model):
    cfg = make_cfg("train", [f"model={model}", f"data={PAIRS[model]}"])
    module = hydra.utils.instantiate(cfg.model)
    assert sum(p.numel() for p in module.parameters()) > 0
    assert len(list(module.net.named_children())) >= 2  # named blocks: the pipeline's split points


@pytest.mark.parametrize("trainer", options("trainer"))
def test_trainer_options_instantiate(make_cfg, trainer):
    """Each trainer config builds the strategy it names, on the devices it names, with atomic checkpoints."""
    if trainer == "mps":
        pytest.skip("trainer=mps needs an Apple GPU; tests/test_experiments.py checks its refusal elsewhere")
    cfg = make_cfg("train", [f"trainer={trainer}", "trainer.accelerator=cpu"])
    built = hydra.utils.instantiate(cfg.trainer)
    assert type(built.strategy) is hydra.utils.get_class(cfg.trainer.strategy._target_)
    assert built.num_devices == cfg.trainer.devices and built.max_epochs == cfg.trainer.max_epochs
    assert isinstance(built.strategy.checkpoint_io, AtomicCheckpointIO)  # every strategy's default


@pytest.mark.parametrize("callbacks", options("callbacks"))
def test_callback_options_instantiate(make_cfg, callbacks):
    extra = ["callbacks.early_stopping.monitor=val/loss"] if callbacks == "early_stopping" else []
    cfg = make_cfg("train", [f"callbacks={callbacks}", *extra])
    built = instantiate_callbacks(cfg.get("callbacks"))
    assert all(isinstance(c, Callback) for c in built)
    assert (len(built) == 0) == (callbacks == "none")


@pytest.mark.parametrize("logger", options("logger"))
def test_logger_options_instantiate(make_cfg, logger, monkeypatch):
    needed = [pkg for name, pkg in OPTIONAL_PACKAGES.items() if name in logger or logger == "many_loggers"]
    missing = [pkg for pkg in needed if importlib.util.find_spec(pkg) is None]
    if missing and logger != "many_loggers":
        pytest.skip(f"optional logger package not installed: {missing} (pip install -e '.[loggers]')")
    cfg = make_cfg("train", [f"logger={logger}"])
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # Hydra's job.env_set does this in a real run
    built = instantiate_loggers(cfg.get("logger"))
    assert all(isinstance(lg, Logger) for lg in built)
    assert (len(built) == 0) == (logger == "none")


@pytest.mark.parametrize("group", ["debug", "experiment", "hparams_search"])
def test_global_groups_compose(make_cfg, group):
    """Every option of a global group composes and changes the run it is added to."""
    base = OmegaConf.to_container(make_cfg("train", [], subdir="base"), resolve=False)
    for option in options(group):
        cfg = make_cfg("train", [f"{group}={option}"], subdir=f"{group}-{option}")
        assert cfg.model._target_ and cfg.data._target_
        changed = OmegaConf.to_container(cfg, resolve=False)
        for node in (changed, base):
            node.pop("hydra", None)
        assert changed != base, f"{group}={option} changes nothing"


def test_eval_config_composes(make_cfg):
    cfg = make_cfg("eval", ["ckpt_path=x.ckpt"])
    assert cfg.ckpt_path == "x.ckpt" and cfg.task_name == "eval"


def test_every_option_in_the_config_groups_table_exists():
    """The config-groups table (docs/configs.md) names options that exist, and every option that exists is named."""
    table = [line for line in (ROOT / "docs" / "configs.md").read_text().splitlines() if re.match(r"^\| `\w+` \|", line)]
    documented = {}
    for line in table:
        group, options_cell = (cell.strip() for cell in line.strip("|").split("|")[:2])
        documented[group.strip("`")] = set(re.findall(r"`(\w+)`", options_cell))
    checked = {"data", "model", "trainer", "logger", "debug", "experiment", "hparams_search"}
    assert checked <= documented.keys()
    for group in checked:
        assert documented[group] == set(options(group)), group


@pytest.mark.fast
def test_mnist_datamodule_loads_mnist_and_the_fashion_one_fashion_mnist(mnist_format_dir):
    """As in ashleve's template, ``MNISTDataModule()`` is MNIST; the offline default is ``FashionMNISTDataModule``."""
    from src.data.mnist_datamodule import FashionMNISTDataModule, MNISTDataModule

    mnist = MNISTDataModule(data_dir=str(mnist_format_dir), download=False)
    mnist.prepare_data()
    mnist.setup()
    assert mnist.hparams.dataset == "mnist" and mnist.dataset_cls.__name__ == "MNIST"
    assert len(mnist.data_train) + len(mnist.data_val) == 60_000
    assert FashionMNISTDataModule().dataset_cls.__name__ == "FashionMNIST"


@pytest.mark.fast
def test_src_engine_exports_ashleves_names_without_importing_lightning():
    import subprocess
    import sys

    code = ("import sys; from src.engine import DataError; assert 'lightning' not in sys.modules; "
            "from src.engine import extras, task_wrapper, get_metric_value, instantiate_callbacks, instantiate_loggers, "
            "log_hyperparameters, print_config_tree, RankedLogger; print(task_wrapper.__module__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "src.engine.utils.task"


@pytest.mark.fast
def test_configs_resolve_through_hydras_compose_api_without_importing_the_project():
    """A notebook or ashleve's tests compose with Hydra's API and never call register_resolvers(): the
    hydra_plugins/project_resolvers module registers them when Hydra starts."""
    import subprocess
    import sys

    code = ("import sys\nfrom hydra import compose, initialize\n"
            "with initialize(version_base='1.3', config_path='configs'):\n"
            "    cfg = compose(config_name='train.yaml', return_hydra_config=True)\n"
            "print(cfg.trainer.benchmark, 'lightning' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "False"]  # ${not:${trainer.deterministic}}, and no Lightning import
