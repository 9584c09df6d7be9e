"""Checks of the composed config alone, before anything is built: one clear line for each combination that
would otherwise fail late, hang, or crash a child rank.

What needs built objects is checked where they are built: each strategy checks itself
(``check_before_launch``), and :func:`src.engine.strategies.launchers.preflight` runs those checks and the
global-batch rule before any rank starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hydra
import torch
import torch.distributed as dist
from omegaconf import DictConfig

from src.engine.utils.errors import ConfigError
from src.engine.utils.hooks import ChecksTrainerConfig

CONFIG_DIR = Path(__file__).resolve().parents[3] / "configs"  # the root is three up from src/engine/utils/
_GPU_NAMES = ("gpu", "cuda")


def check_config(cfg: DictConfig) -> None:
    """Everything the composed config alone can show, before any object is built."""
    check_model_data_pair(cfg)
    check_optimizer(cfg.model.get("optimizer"), scheduler_cfg=cfg.model.get("scheduler"))
    check_trainer_config(cfg.trainer)


def check_model_data_pair(cfg: DictConfig) -> None:
    """The model and the data must be of one kind (``task``: classification, regression), as their classes say.

    Read from the classes the config names, before anything is built.
    """
    model_task, data_task = _task_of(cfg.model), _task_of(cfg.data)
    if model_task is None or data_task is None or model_task == data_task:
        return
    choices = _choices()
    model_name, data_name = choices.get("model", cfg.model._target_), choices.get("data", cfg.data._target_)
    data_fits = _configs_of_task("data", model_task)
    model_fits = _configs_of_task("model", data_task)
    fixes = [f"use data={data_fits[0]}" if data_fits else f"use {model_task} data"]
    if model_fits:
        fixes.append(f"use model={model_fits[0]} with data={data_name}")
    raise ConfigError(f"model={model_name} is a {model_task} model but data={data_name} holds {data_task} data; "
                      f"fix: {', or '.join(fixes)}")


def _task_of(node: DictConfig) -> str | None:
    target = node.get("_target_") if isinstance(node, DictConfig) else None
    try:
        return getattr(hydra.utils.get_class(target), "task", None) if target else None
    except Exception:  # an unknown target fails where it is built, with Hydra's own message
        return None


def _choices() -> dict[str, str]:
    from hydra.core.hydra_config import HydraConfig

    return dict(HydraConfig.get().runtime.choices) if HydraConfig.initialized() else {}


def _configs_of_task(group: str, task: str) -> list[str]:
    """Names of the ``configs/<group>/*.yaml`` whose class declares ``task``."""
    from omegaconf import OmegaConf

    names = []
    for path in sorted((CONFIG_DIR / group).glob("*.yaml")):
        node = OmegaConf.load(path)
        if isinstance(node, DictConfig) and "_target_" not in node:  # a `# @package _global_` config
            node = node.get(group)
        if isinstance(node, DictConfig) and _task_of(node) == task:
            names.append(path.stem)
    return names


def _strategy_option(trainer_cfg: DictConfig, key: str):
    strategy = trainer_cfg.get("strategy")
    return strategy.get(key) if isinstance(strategy, DictConfig) else None


def check_optimizer(optimizer_cfg: DictConfig | None, where: str = "model.optimizer",
                    scheduler_cfg: DictConfig | None = None) -> None:
    """Values torch's optimizers and schedulers reject at their construction, inside every rank, after the launch.

    Negative ``lr``/``weight_decay``/``momentum``/``eps`` are named here; a ``torch.optim`` optimizer (and its
    ``torch.optim.lr_scheduler`` scheduler) is then built once on a dummy parameter, so any other value they
    reject (``betas``, a string for a number, a plateau ``factor`` of 2) fails now too.
    """
    if not isinstance(optimizer_cfg, DictConfig):
        return
    for key in ("lr", "weight_decay", "momentum", "eps"):
        value = optimizer_cfg.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and value < 0:
            raise ConfigError(
                f"{where}.{key}={value} must be >= 0; fix: set a non-negative value, "
                f"e.g. {where}.{key}={_EXAMPLES[key]}"
            )
    if not _plain_torch_partial(optimizer_cfg, "torch.optim."):
        return  # built elsewhere, or not a plain torch optimizer: no trial construction
    optimizer = _try_build(optimizer_cfg, where, params=[torch.zeros(1, requires_grad=True)])
    if optimizer is not None and isinstance(scheduler_cfg, DictConfig) and _plain_torch_partial(scheduler_cfg, "torch.optim.lr_scheduler."):
        _try_build(scheduler_cfg, "model.scheduler", optimizer=optimizer)


def _plain_torch_partial(cfg: DictConfig, prefix: str) -> bool:
    return str(cfg.get("_target_", "")).startswith(prefix) and bool(cfg.get("_partial_", False))


def _try_build(cfg: DictConfig, where: str, **arguments: Any) -> Any:
    """``instantiate(cfg)(**arguments)``; a value torch rejects is one line naming ``where``."""
    target = cfg.get("_target_")
    try:
        factory = hydra.utils.instantiate(cfg)
    except Exception:  # shows up, with its own message, where it is built
        return None
    try:
        return factory(**arguments)
    except (TypeError, ValueError) as err:  # torch's own checks of the values (a string where a number goes)
        raise ConfigError(f"{where} is invalid: {target} says {' '.join(str(err).split())!r}; fix: correct that "
                          f"value in {where}") from None
    except Exception:  # anything else shows up, with its own message, where it is built
        return None


_EXAMPLES = {"lr": 0.001, "weight_decay": 0.0, "momentum": 0.9, "eps": 1e-08}


def _runs_on_cpu(accelerator: str, gpus: int) -> bool:
    if accelerator == "cpu":
        return True
    return accelerator == "auto" and gpus == 0 and not torch.backends.mps.is_available()


# Trainer options that must be numbers: Lightning takes a string and fails much later with a bare assert
_WHOLE_NUMBERS = ("max_epochs", "min_epochs", "max_steps", "min_steps", "num_nodes", "accumulate_grad_batches",
                  "check_val_every_n_epoch", "log_every_n_steps", "num_sanity_val_steps")
_NUMBERS = ("limit_train_batches", "limit_val_batches", "limit_test_batches", "limit_predict_batches",
            "gradient_clip_val", "overfit_batches")  # not val_check_interval: it also takes a time ("00:01:00:00")


def check_trainer_numbers(trainer_cfg: DictConfig) -> None:
    """``trainer.max_epochs=x`` and the like: one line, before Lightning's assert deep in the fit loop."""
    for keys, kinds, what, example in ((_WHOLE_NUMBERS, int, "a whole number", "3"),
                                       (_NUMBERS, int | float, "a number (a count, or a fraction of 1.0)", "0.5")):
        for key in keys:
            value = trainer_cfg.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, kinds)):
                raise ConfigError(f"trainer.{key}={value!r} must be {what}; fix: e.g. trainer.{key}={example}")
    for key in ("max_epochs", "max_steps"):  # Lightning's own refusal comes inside Hydra's instantiate, exit 1
        value = trainer_cfg.get(key)
        if value is not None and value < -1:
            raise ConfigError(f"trainer.{key}={value} must be >= 0, or -1 for no limit; fix: e.g. trainer.{key}=3")


def check_trainer_config(trainer_cfg: DictConfig) -> None:
    """One clear error for each combination that would otherwise fail late, hang, or crash a child rank."""
    check_trainer_numbers(trainer_cfg)
    accelerator = str(trainer_cfg.get("accelerator", "auto"))
    devices = trainer_cfg.get("devices", 1)
    if isinstance(devices, str) and devices.strip().lstrip("-").isdigit():
        devices = int(devices)
    num_nodes = int(trainer_cfg.get("num_nodes", 1))
    gpus = torch.cuda.device_count()
    uses_gpu = accelerator in _GPU_NAMES or (accelerator == "auto" and gpus > 0)
    if num_nodes < 1:
        raise ConfigError(f"trainer.num_nodes={num_nodes} is below 1; fix: set it to 1 or more")
    if isinstance(devices, int) and devices < 1 and devices != -1:
        every = " (or -1 for every GPU)" if uses_gpu else ""
        raise ConfigError(
            f"trainer.devices={devices} must be >= 1{every}; fix: set trainer.devices=1 or more"
        )
    if accelerator in _GPU_NAMES and gpus == 0:
        raise ConfigError(
            f"trainer.accelerator={accelerator} but no CUDA GPU is visible; fix: use trainer.accelerator=cpu"
        )
    if devices == -1 and _runs_on_cpu(accelerator, gpus):
        why = "trainer.accelerator=cpu" if accelerator == "cpu" else "no GPU is visible"
        raise ConfigError(
            f"trainer.devices=-1 means every GPU, but this run is on the CPU ({why}) and there is no "
            "'every CPU'; fix: give the number of CPU processes (threads for dp), e.g. trainer.devices=2"
        )
    if uses_gpu and isinstance(devices, int) and devices > gpus:
        raise ConfigError(
            f"trainer.devices={devices} but only {gpus} GPU(s) are visible; fix: lower trainer.devices"
        )

    check_with_strategy_class(trainer_cfg)
    backend = _strategy_option(trainer_cfg, "process_group_backend")
    if backend == "nccl" and not uses_gpu:
        raise ConfigError(
            "process_group_backend=nccl needs CUDA GPUs; fix: use gloo on CPU (or leave it null for auto)"
        )
    if backend == "mpi" and not dist.is_mpi_available():
        raise ConfigError(
            "process_group_backend=mpi but this torch build has no MPI support; fix: use gloo or nccl"
        )
    if backend not in (None, "gloo", "nccl", "mpi"):
        raise ConfigError(
            f"process_group_backend={backend!r} is unknown; fix: use gloo, nccl, mpi, or null for auto"
        )


def check_with_strategy_class(trainer_cfg: DictConfig) -> None:
    """A strategy class that owns checks of the trainer config (``check_trainer_config``) runs them now, before
    the Trainer is built: Lightning refuses some combinations inside its constructor, with a traceback."""
    strategy = trainer_cfg.get("strategy")
    target = strategy.get("_target_") if isinstance(strategy, DictConfig) else None
    try:
        cls = hydra.utils.get_class(target) if target else None
    except Exception:  # an unknown target fails where it is built, with Hydra's own message
        return
    if isinstance(cls, type) and issubclass(cls, ChecksTrainerConfig):
        cls.check_trainer_config(trainer_cfg)


def require_step(model: Any, step: str, script: str, fix: str) -> None:
    """One line when ``script`` needs ``model``'s ``step`` (``test_step``, ``predict_step``...) and it has none."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    if not is_overridden(step, model):
        raise ConfigError(f"{script} runs {type(model).__name__}.{step}, which it does not define; fix: {fix}")
