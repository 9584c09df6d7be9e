"""Validation before any process starts, in one place; root causes are reported first.

Two moments, because some settings make the Trainer itself fail to build:

* :func:`check_config`, on the config, before anything is built: model/data pairing, optimizer values,
  devices, accelerator, backend, rendezvous address and port (a non-zero node waits a bounded time for
  node 0: ``RENDEZVOUS_TIMEOUT`` seconds, default 120), the SIGTERM interval;
* :func:`preflight`, once the Trainer and model exist and before any rank is launched: each
  strategy's own ``validate(trainer, model)`` (model structure first, then its settings), then the
  global-batch rule. The project's launchers call it too, so ``Trainer(strategy=...)`` users get
  the same checks without ``src/train.py``.
"""

from __future__ import annotations

import os
import socket

import hydra
import lightning as L
import torch
import torch.distributed as dist
from omegaconf import DictConfig

from src.strategies import lightning_compat as compat
from src.strategies.batch import per_replica_batch_size
from src.strategies.ports import parse_port, port_in_use, wait_for_listener
from src.strategies.sigterm import check_interval
from src.utils.errors import ConfigError

_GPU_NAMES = ("gpu", "cuda")


def check_config(cfg: DictConfig) -> None:
    """Everything the composed config alone can show, before any object is built."""
    check_model_data_pair(cfg)
    check_optimizer(cfg.model.get("optimizer"))
    check_trainer_config(cfg.trainer)
    check_interval(cfg.get("sigterm_check_every_n_batches", 10))


def check_model_data_pair(cfg: DictConfig) -> None:
    """The toy regression model needs the toy data, and classifiers need labelled images."""
    regression_model = str(cfg.model.get("_target_", "")).endswith("RegressionModule")
    regression_data = "num_classes" not in cfg.data
    if regression_model and not regression_data:
        raise ConfigError(
            "model=toy is a regression model for synthetic vectors: use data=toy (or experiment=toy)"
        )
    if regression_data and not regression_model:
        raise ConfigError("data=toy is regression data: use model=toy (or experiment=toy)")


def _strategy_option(trainer_cfg: DictConfig, key: str):
    strategy = trainer_cfg.get("strategy")
    return strategy.get(key) if isinstance(strategy, DictConfig) else None


def check_optimizer(optimizer_cfg: DictConfig | None, where: str = "model.optimizer") -> None:
    """Values torch's optimizers reject at their construction, inside every rank, after the launch.

    Negative ``lr``/``weight_decay``/``momentum``/``eps`` are named here; a ``torch.optim`` optimizer is
    then built once on a dummy parameter, so any other value it rejects (e.g. ``betas``) fails now too.
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
    target = str(optimizer_cfg.get("_target_", ""))
    if not target.startswith("torch.optim.") or not optimizer_cfg.get("_partial_", False):
        return  # built elsewhere, or not a plain torch optimizer: no trial construction
    try:
        factory = hydra.utils.instantiate(optimizer_cfg)
        factory([torch.zeros(1, requires_grad=True)])
    except ValueError as err:  # torch's own checks of the values
        raise ConfigError(
            f"{where} is invalid: {target} says {str(err).strip()!r}; fix: correct that value in {where}"
        ) from None
    except Exception:  # anything else shows up, with its own message, where it is built
        return


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
        raise ConfigError(f"trainer.num_nodes={num_nodes} must be >= 1")
    if isinstance(devices, int) and devices < 1 and devices != -1:
        every = " (or -1 for every GPU)" if uses_gpu else ""
        raise ConfigError(
            f"trainer.devices={devices} must be >= 1{every}; fix: set trainer.devices=1 or more"
        )
    if accelerator in _GPU_NAMES and gpus == 0:
        raise ConfigError(
            f"trainer.accelerator={accelerator} but no CUDA GPU is visible: use trainer.accelerator=cpu"
        )
    if devices == -1 and _runs_on_cpu(accelerator, gpus):
        why = "trainer.accelerator=cpu" if accelerator == "cpu" else "no GPU is visible"
        raise ConfigError(
            f"trainer.devices=-1 means every GPU, but this run is on the CPU ({why}) and there is no "
            "'every CPU'; fix: give the number of CPU processes (threads for dp), e.g. trainer.devices=2"
        )
    if uses_gpu and isinstance(devices, int) and devices > gpus:
        raise ConfigError(
            f"trainer.devices={devices} but only {gpus} GPU(s) are visible: lower trainer.devices"
        )

    backend = _strategy_option(trainer_cfg, "process_group_backend")
    if backend == "nccl" and not uses_gpu:
        raise ConfigError(
            "process_group_backend=nccl needs CUDA GPUs: use gloo on CPU (or leave it null for auto)"
        )
    if backend == "mpi" and not dist.is_mpi_available():
        raise ConfigError(
            "process_group_backend=mpi but this torch build has no MPI support: use gloo or nccl"
        )
    if backend not in (None, "gloo", "nccl", "mpi"):
        raise ConfigError(
            f"process_group_backend={backend!r} is not one of gloo, nccl, mpi (or null for auto)"
        )
    if _starts_process_group(trainer_cfg, devices, num_nodes):
        _check_rendezvous_port()
        _wait_for_node_zero(num_nodes)


def _starts_process_group(trainer_cfg: DictConfig, devices, num_nodes: int) -> bool:
    """Whether this run joins a process group (MASTER_ADDR/MASTER_PORT matter): not dp, not one device."""
    strategy = trainer_cfg.get("strategy")
    target = (
        str(strategy.get("_target_", "")) if isinstance(strategy, DictConfig) else str(strategy or "auto")
    )
    if target == "dp" or target.endswith("DataParallelStrategy"):
        return False
    if "ddp" in target.lower() or "pipeline" in target.lower() or num_nodes > 1:
        return True
    return devices not in (1, "1", None, "auto") and target not in ("single_device",)


def _check_rendezvous_port() -> None:
    """MASTER_PORT must be a port number; a busy one makes the rank-0 TCP store fail after a long wait.

    Only the process that will host the store checks for a busy port (node 0, not yet a child rank).
    When MASTER_PORT is unset, Lightning picks a free port itself.
    """
    port = os.environ.get("MASTER_PORT")
    if port is None:
        return
    number = parse_port(port)
    if number is None:
        raise ConfigError(
            f"MASTER_PORT={port} is not a TCP port number (1-65535); fix: unset MASTER_PORT to pick a "
            "free port, or set it to a free port such as 29500"
        )
    is_host = os.environ.get("NODE_RANK", "0") == "0" and "LOCAL_RANK" not in os.environ
    is_host = is_host and "TORCHELASTIC_RUN_ID" not in os.environ and "SLURM_PROCID" not in os.environ
    if is_host and port_in_use(number, os.environ.get("MASTER_ADDR", "127.0.0.1")):
        raise ConfigError(
            f"MASTER_PORT={port} is already in use on this machine: unset it to pick a free port, "
            "or choose another"
        )


RENDEZVOUS_TIMEOUT = "RENDEZVOUS_TIMEOUT"  # seconds a non-zero node waits for node 0's rendezvous
DEFAULT_RENDEZVOUS_TIMEOUT_S = 120.0


def rendezvous_timeout() -> float:
    """``RENDEZVOUS_TIMEOUT`` (seconds), default 120."""
    text = os.environ.get(RENDEZVOUS_TIMEOUT)
    if text is None:
        return DEFAULT_RENDEZVOUS_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConfigError(
            f"{RENDEZVOUS_TIMEOUT}={text} must be a number of seconds > 0; fix: e.g. "
            f"{RENDEZVOUS_TIMEOUT}=300, or unset it for {DEFAULT_RENDEZVOUS_TIMEOUT_S:g}"
        )
    return value


def _wait_for_node_zero(num_nodes: int) -> None:
    """A node started with NODE_RANK>0 waits a bounded time for node 0's rendezvous at MASTER_ADDR:MASTER_PORT.

    Without this, torch's store client retries for the whole process-group timeout (30 minutes) and then
    fails with C++ frames. Nodes started by torchrun or SLURM are left to those launchers; a node's child
    ranks (LOCAL_RANK) join after their parent has seen node 0.
    """
    node_rank = os.environ.get("NODE_RANK", "0")
    if num_nodes < 2 or node_rank == "0" or "LOCAL_RANK" in os.environ:
        return
    if "TORCHELASTIC_RUN_ID" in os.environ or "SLURM_PROCID" in os.environ:
        return
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        raise ConfigError(
            f"NODE_RANK={node_rank} joins node 0's rendezvous, but MASTER_ADDR and MASTER_PORT are "
            "not both set; fix: export MASTER_ADDR=<node 0's address> MASTER_PORT=<its port> on "
            "every node"
        )
    timeout = rendezvous_timeout()
    try:
        reachable = wait_for_listener(addr, int(port), timeout)
    except socket.gaierror as err:
        raise ConfigError(
            f"MASTER_ADDR={addr} does not resolve ({err.strerror}); fix: set MASTER_ADDR to node "
            "0's address or host name"
        ) from None
    if not reachable:
        raise ConfigError(
            f"nothing listens at MASTER_ADDR:MASTER_PORT={addr}:{port} after {timeout:g} s (node "
            f"{node_rank} of {num_nodes} waits for node 0's rendezvous there); fix: start node 0 "
            "(NODE_RANK=0) with the same MASTER_ADDR and MASTER_PORT, check that address and that the "
            f"port is open between the machines, or wait longer with {RENDEZVOUS_TIMEOUT}=<seconds>"
        )


def preflight(
    trainer: L.Trainer, model: L.LightningModule, datamodule: L.LightningDataModule | None = None
) -> None:
    """Check the strategy against ``model``, then the global batch (idempotent, cheap)."""
    strategy = trainer.strategy
    validate = getattr(strategy, "validate", None)
    if callable(validate):
        validate(trainer, model)
    if compat.layer_sync_of(strategy) is not None and strategy.root_device.type != "cuda":
        raise ConfigError(
            "trainer.sync_batchnorm=true needs CUDA GPUs (torch's SyncBatchNorm is GPU-only): "
            "set trainer.sync_batchnorm=false on CPU"
        )
    check_data_dir = getattr(datamodule, "check_data_dir", None)
    if callable(check_data_dir):  # a DataModule that writes its files: into a folder it can write
        check_data_dir()
    if getattr(strategy, "strategy_name", None) == "dp":
        _check_dp_batch(datamodule, len(strategy.parallel_devices or []))
    if getattr(
        datamodule, "batch_size_is_global", False
    ):  # the project's DataModules; others keep their meaning
        per_replica_batch_size(datamodule.hparams.batch_size, strategy)


def _check_dp_batch(datamodule: L.LightningDataModule | None, devices: int) -> None:
    """dp splits each batch over its devices, whatever the DataModule means by batch size: one sample each at least.

    Otherwise the first training step fails. DataModules that declare no batch size are not checked.
    """
    hparams = getattr(datamodule, "hparams", None) or {}
    batch = hparams.get("batch_size", getattr(datamodule, "batch_size", None))
    if isinstance(batch, int) and not isinstance(batch, bool) and 0 < batch < devices:
        raise ConfigError(
            f"data.batch_size={batch} cannot give each of the {devices} dp devices a sample; fix: "
            f"raise data.batch_size to at least {devices}, or lower trainer.devices"
        )
