"""Validation before any process starts, in one place; root causes are reported first.

Two moments, because some settings make the Trainer itself fail to build:

* :func:`check_config`, on the config, before anything is built: model/data pairing, devices,
  accelerator, backend, rendezvous port, the SIGTERM interval;
* :func:`preflight`, once the Trainer and model exist and before any rank is launched: each
  strategy's own ``validate(trainer, model)`` (model structure first, then its settings), then the
  global-batch rule. The project's launchers call it too, so ``Trainer(strategy=...)`` users get
  the same checks without ``src/train.py``.
"""

from __future__ import annotations

import os

import lightning as L
import torch
import torch.distributed as dist
from omegaconf import DictConfig

from src.strategies import lightning_compat as compat
from src.strategies.batch import per_replica_batch_size
from src.strategies.ports import port_in_use
from src.strategies.sigterm import check_interval
from src.utils.errors import ConfigError

_GPU_NAMES = ("gpu", "cuda")


def check_config(cfg: DictConfig) -> None:
    """Everything the composed config alone can show, before any object is built."""
    check_model_data_pair(cfg)
    check_trainer_config(cfg.trainer)
    check_interval(cfg.get("sigterm_check_every_n_batches", 10))


def check_model_data_pair(cfg: DictConfig) -> None:
    """The toy regression model needs the toy data, and classifiers need labelled images."""
    regression_model = str(cfg.model.get("_target_", "")).endswith("RegressionModule")
    regression_data = "num_classes" not in cfg.data
    if regression_model and not regression_data:
        raise ConfigError("model=toy is a regression model for synthetic vectors: use data=toy (or experiment=toy)")
    if regression_data and not regression_model:
        raise ConfigError("data=toy is regression data: use model=toy (or experiment=toy)")


def _strategy_option(trainer_cfg: DictConfig, key: str):
    strategy = trainer_cfg.get("strategy")
    return strategy.get(key) if isinstance(strategy, DictConfig) else None


def check_trainer_config(trainer_cfg: DictConfig) -> None:
    """One clear error for each combination that would otherwise fail late, hang, or crash a child rank."""
    accelerator = str(trainer_cfg.get("accelerator", "auto"))
    devices = trainer_cfg.get("devices", 1)
    num_nodes = int(trainer_cfg.get("num_nodes", 1))
    gpus = torch.cuda.device_count()
    if num_nodes < 1:
        raise ConfigError(f"trainer.num_nodes={num_nodes} must be >= 1")
    if isinstance(devices, int) and devices < 1 and devices != -1:
        raise ConfigError(f"trainer.devices={devices} must be >= 1 (or -1 for all)")
    if accelerator in _GPU_NAMES and gpus == 0:
        raise ConfigError(f"trainer.accelerator={accelerator} but no CUDA GPU is visible: use trainer.accelerator=cpu")
    uses_gpu = accelerator in _GPU_NAMES or (accelerator == "auto" and gpus > 0)
    if uses_gpu and isinstance(devices, int) and devices > gpus:
        raise ConfigError(f"trainer.devices={devices} but only {gpus} GPU(s) are visible: lower trainer.devices")

    backend = _strategy_option(trainer_cfg, "process_group_backend")
    if backend == "nccl" and not uses_gpu:
        raise ConfigError("process_group_backend=nccl needs CUDA GPUs: use gloo on CPU (or leave it null for auto)")
    if backend == "mpi" and not dist.is_mpi_available():
        raise ConfigError("process_group_backend=mpi but this torch build has no MPI support: use gloo or nccl")
    if backend not in (None, "gloo", "nccl", "mpi"):
        raise ConfigError(f"process_group_backend={backend!r} is not one of gloo, nccl, mpi (or null for auto)")
    _check_rendezvous_port()


def _check_rendezvous_port() -> None:
    """A busy MASTER_PORT makes the rank-0 TCP store fail after a long wait; say so up front.

    Only the process that will host the store checks (node 0, not yet a child rank). When
    MASTER_PORT is unset, Lightning picks a free port itself.
    """
    port = os.environ.get("MASTER_PORT")
    is_host = os.environ.get("NODE_RANK", "0") == "0" and "LOCAL_RANK" not in os.environ
    is_host = is_host and "TORCHELASTIC_RUN_ID" not in os.environ and "SLURM_PROCID" not in os.environ
    if port and is_host and port_in_use(int(port), os.environ.get("MASTER_ADDR", "127.0.0.1")):
        raise ConfigError(f"MASTER_PORT={port} is already in use on this machine: unset it to pick a free port, "
                          "or choose another")


def preflight(trainer: L.Trainer, model: L.LightningModule, datamodule: L.LightningDataModule | None = None) -> None:
    """Check the strategy against ``model``, then the global batch (idempotent, cheap)."""
    strategy = trainer.strategy
    validate = getattr(strategy, "validate", None)
    if callable(validate):
        validate(trainer, model)
    if compat.layer_sync_of(strategy) is not None and strategy.root_device.type != "cuda":
        raise ConfigError("trainer.sync_batchnorm=true needs CUDA GPUs (torch's SyncBatchNorm is GPU-only): "
                          "set trainer.sync_batchnorm=false on CPU")
    if getattr(datamodule, "batch_size_is_global", False):  # the project's DataModules; others keep their meaning
        per_replica_batch_size(datamodule.hparams.batch_size, strategy)
