"""The ``dp`` strategy: one process, each batch split across devices (CPU: threads), exact vs one device."""

from __future__ import annotations

import threading
from functools import partial
from typing import NamedTuple

import hydra
import pytest
import torch
from lightning import Callback, Trainer, seed_everything
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.strategies import StrategyRegistry
from torch import Tensor, nn

import src.engine.strategies  # noqa: F401  (registers "dp")
from src.data.toy_datamodule import ToyDataModule
from src.engine.data.in_memory_datamodule import InMemoryDataModule
from src.engine.strategies.dp import DataParallelStrategy
from src.engine.strategies.dp.shards import ShardRunner
from src.engine.strategies.launchers import preflight
from src.engine.utils.errors import ConfigError
from src.engine.utils.lightning_compat import replica_sharing_parameters as shared_replica
from src.models.classification_module import ClassificationModule
from src.models.components.mlp import MLP
from src.models.components.toy_net import ToyNet
from src.models.regression_module import RegressionModule
from tests.helpers.entry import run_entry
from tests.helpers.run_if import requires_2_gpus
from tests.test_bad_input import error_line


class Call(NamedTuple):
    size: int
    thread: int
    weight_device: torch.device  # on a GPU replica: the device of the replica's own weight copy
    grad: bool
    inference: bool
    autocast: bool


class Recording:
    """Mixin: remember what every ``model_step`` call saw (shard size, thread, device, torch modes)."""

    def model_step(self, batch):
        device = self.net.net1[0].weight.device
        modes = (
            torch.is_grad_enabled(),
            torch.is_inference_mode_enabled(),
            torch.is_autocast_enabled(device.type),
        )
        self.calls.append(Call(batch[0].shape[0], threading.get_ident(), device, *modes))
        return super().model_step(batch)


class RecordingRegression(Recording, RegressionModule):
    def __init__(self) -> None:
        super().__init__(net=ToyNet(), optimizer=partial(torch.optim.SGD, lr=0.1))
        self.calls: list[Call] = []


class ImageDataModule(InMemoryDataModule):
    """Random 1x8x8 images labelled by a fixed random linear teacher: a fast classification task."""

    def __init__(self, batch_size: int = 32, val_size: int = 97) -> None:
        super().__init__(batch_size=batch_size, val_size=val_size)

    def load_split(self, train: bool) -> tuple[Tensor, Tensor]:
        gen = torch.Generator().manual_seed(0 if train else 1)
        x = torch.randn(480 if train else 100, 1, 8, 8, generator=gen)
        teacher = torch.randn(64, 10, generator=torch.Generator().manual_seed(2))
        return x, (x.flatten(1) @ teacher).argmax(dim=1)


class GradCapture(Callback):
    """Keep a copy of every gradient after the first backward."""

    def __init__(self) -> None:
        self.grads: dict[str, Tensor] = {}

    def on_after_backward(self, trainer, pl_module) -> None:
        if not self.grads:
            self.grads = {n: p.grad.detach().cpu().clone() for n, p in pl_module.named_parameters()}


def _trainer(strategy="auto", devices=1, accelerator="cpu", **kwargs) -> Trainer:
    options = dict(
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False
    )
    return Trainer(strategy=strategy, accelerator=accelerator, devices=devices, **{**options, **kwargs})


def _one_step(strategy, devices, batch_size, accelerator="cpu", **kwargs):
    seed_everything(0)
    module = RecordingRegression()
    capture = GradCapture()
    options = dict(max_steps=1, limit_val_batches=0, callbacks=[capture])
    trainer = _trainer(strategy, devices, accelerator, **{**options, **kwargs})
    trainer.fit(module, ToyDataModule(num_samples=256, val_size=32, num_test=32, batch_size=batch_size))
    return capture.grads, module.calls


# -- 1. one step: same gradients as a full-batch single-device step ------------------------------


@pytest.mark.fast
@pytest.mark.parametrize(
    ("devices", "batch_size", "shards"), [(2, 8, [4, 4]), (2, 7, [4, 3]), (3, 7, [3, 2, 2])]
)
def test_dp_step_gradients_equal_single_device(devices, batch_size, shards):
    single, single_calls = _one_step("auto", 1, batch_size)
    dp, dp_calls = _one_step("dp", devices, batch_size)
    assert [c.size for c in single_calls] == [batch_size]
    assert sorted((c.size for c in dp_calls), reverse=True) == shards  # each replica saw its shard
    assert len({c.thread for c in dp_calls}) > 1  # shards ran in parallel threads
    assert single.keys() == dp.keys() and single
    for name in single:
        torch.testing.assert_close(dp[name], single[name], rtol=0, atol=1e-6, msg=name)


@pytest.mark.fast
def test_worker_threads_inherit_grad_inference_and_autocast_modes():
    module = RecordingRegression()
    trainer = _trainer(
        "dp", 2, precision="bf16-mixed", max_steps=1, limit_val_batches=0, limit_test_batches=1
    )
    data = ToyDataModule(num_samples=64, val_size=16, num_test=8, batch_size=8)
    trainer.fit(module, data)
    trainer.test(module, data, verbose=False)  # Lightning tests under torch.inference_mode
    train, test = module.calls[:2], module.calls[2:]
    assert len(test) == 2 and len({c.thread for c in module.calls}) > 1
    assert all(c.grad and not c.inference and c.autocast for c in train)
    assert all(not c.grad and c.inference and c.autocast for c in test)


@pytest.mark.fast
def test_cpu_replica_shares_parameters_but_not_buffers():
    root = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    replica = shared_replica(root)
    assert replica[0].weight is root[0].weight and replica[1].bias is root[1].bias
    assert replica[1].running_mean is not root[1].running_mean
    replica.train()(torch.randn(8, 4))  # a non-root shard's BatchNorm update must not touch the root
    assert torch.equal(root[1].running_mean, torch.zeros(4))
    assert all(a is b for a, b in zip(replica.parameters(), root.parameters(), strict=True))


@pytest.mark.fast
def test_a_failing_shard_reraises_its_own_error():
    def step(i):
        if i == 1:
            raise ValueError("shard 1 failed")
        return i

    runner = ShardRunner(2)
    try:
        with pytest.raises(ValueError, match="shard 1 failed"):
            runner.run(step, [(0,), (1,)], [torch.device("cpu")] * 2)
    finally:
        runner.close()


# -- 2. a full epoch: same logged metrics and weights --------------------------------------------


def _epoch(kind, strategy, devices):
    seed_everything(0)
    adam = partial(torch.optim.Adam, lr=1e-2)
    if kind == "regression":
        module = RegressionModule(net=ToyNet(), optimizer=adam)
        # 97 validation samples in batches of 32: the last batch (1 sample) is shorter than the device count
        data = ToyDataModule(num_samples=609, val_size=97, num_test=100, batch_size=32)
    else:
        module = ClassificationModule(net=MLP(1, 8, hidden_sizes=[32], dropout=0.0), optimizer=adam)
        data = ImageDataModule()
    trainer = _trainer(strategy, devices, max_epochs=1, num_sanity_val_steps=0)
    trainer.fit(module, data)
    fit_metrics = {k: v.item() for k, v in trainer.callback_metrics.items()}
    test_metrics = trainer.test(module, data, verbose=False)[0]
    return fit_metrics, test_metrics, {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.fast
@pytest.mark.parametrize("kind", ["regression", "classification"])
def test_dp_epoch_matches_single_device(kind):
    fit_1, test_1, weights_1 = _epoch(kind, "auto", 1)
    fit_dp, test_dp, weights_dp = _epoch(kind, "dp", 2)
    expected = {"train/loss", "val/loss"} | (
        {"val/acc", "val/acc_best"} if kind == "classification" else set()
    )
    assert expected <= fit_1.keys() == fit_dp.keys()
    assert fit_dp == pytest.approx(fit_1, rel=1e-5, abs=1e-6)
    assert test_dp == pytest.approx(test_1, rel=1e-5, abs=1e-6)
    assert weights_1.keys() == weights_dp.keys()
    for name in weights_1:
        torch.testing.assert_close(weights_dp[name], weights_1[name], rtol=1e-5, atol=1e-6, msg=name)


# -- 3. registration and bad input ---------------------------------------------------------------


@pytest.mark.fast
def test_registered_and_single_process():
    assert "dp" in StrategyRegistry
    strategy = _trainer("dp", 3).strategy
    assert isinstance(strategy, DataParallelStrategy)
    assert strategy.parallel_devices == [torch.device("cpu")] * 3
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 1, "rank": 0}  # no data sharding
    assert (strategy.world_size, strategy.global_rank, strategy.is_global_zero) == (1, 0, True)
    value = torch.tensor(2.0)
    assert (
        strategy.reduce(value) is value and strategy.all_gather(value) is value and strategy.broadcast(3) == 3
    )


@pytest.mark.fast
def test_bad_configurations_fail_early():
    with pytest.raises(ConfigError, match="dp is single-process; fix: use trainer=ddp"):
        _trainer("dp", 2, num_nodes=2)
    with pytest.raises(ConfigError, match="dp is single-process"):
        _trainer(DataParallelStrategy(), 2, num_nodes=2)
    with pytest.raises(ConfigError, match="sync_batchnorm=false"):  # at fit, before any step
        _trainer("dp", 2, sync_batchnorm=True, max_steps=1).fit(
            RecordingRegression(), ToyDataModule(num_samples=64, val_size=16, batch_size=8))
    with pytest.raises(ConfigError, match=r"trainer=dp needs model_step\(batch\) -> dict.*BoringModel lacks model_step, record_step"):
        _trainer("dp", 2, max_steps=1).fit(BoringModel())
    compiled = RegressionModule(net=ToyNet(), optimizer=partial(torch.optim.SGD, lr=0.1), compile=True)
    with pytest.raises(ConfigError, match="model.compile=false"):
        _trainer("dp", 2, max_steps=1).fit(compiled, ToyDataModule(num_samples=64, val_size=16, batch_size=8))
    with pytest.raises(ConfigError, match=r"net \(model.compile=true\).*fix: set model.compile=false"):  # pre-flight
        preflight(_trainer("dp", 2, max_steps=1), compiled, ToyDataModule(num_samples=64, val_size=16, batch_size=8))


@pytest.mark.fast
def test_batch_smaller_than_devices_is_a_clear_error():
    data = ToyDataModule(num_samples=64, val_size=16, batch_size=1)
    with pytest.raises(  # the global-batch rule, before sanity validation or any step
        ConfigError, match="data.batch_size=1 cannot give each of the 2 dp devices a sample; fix: raise data.batch_size"
    ):
        _trainer("dp", 2, max_steps=1, limit_val_batches=0).fit(RecordingRegression(), data)


# -- 4. the entry point: `python src/train.py trainer=dp trainer.devices=2` ---------------------------


NO_BAR = ["++callbacks.rich_progress_bar=null"]  # tiny test configs turn the progress bar off


def test_train_with_dp_config_and_load_checkpoint_on_one_device(make_cfg):
    from omegaconf import OmegaConf

    from src.eval import evaluate
    from src.train import train
    from tests.helpers.config import CONFIG_DIR

    cfg = make_cfg("train", ["trainer=dp", "trainer.devices=2", *NO_BAR], subdir="train")  # tiny configs: CPU
    assert OmegaConf.load(CONFIG_DIR / "trainer" / "dp.yaml").accelerator == "auto"  # what users get
    assert cfg.trainer.accelerator == "cpu" and cfg.trainer.strategy._target_.endswith(
        "DataParallelStrategy"
    )
    metrics, objects = train(cfg)
    trainer = objects["trainer"]
    assert (
        isinstance(trainer.strategy, DataParallelStrategy) and trainer.num_devices == 2
    )  # CPU box: 2 threads
    assert {"train/loss", "val/acc", "test/loss", "test/acc"} <= metrics.keys()
    ckpt = trainer.checkpoint_callback.best_model_path
    assert ckpt

    # plain keys (no `module.` prefix): loads strictly into a fresh single-device model ...
    fresh = hydra.utils.instantiate(cfg.model)
    fresh.load_state_dict(torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"])
    # ... and src/eval.py on one device reproduces the dp test metrics exactly
    eval_cfg = make_cfg("eval", [f"ckpt_path={ckpt}", *NO_BAR], subdir="eval")
    eval_metrics, _ = evaluate(eval_cfg)
    for key in ("test/loss", "test/acc"):
        assert eval_metrics[key].item() == pytest.approx(metrics[key].item(), rel=1e-5), key


# -- 5. real replication on GPUs -----------------------------------------------------------------


@pytest.mark.gpu
@requires_2_gpus
def test_dp_on_two_gpus_replicates_and_matches_single_gpu():
    single, _ = _one_step("auto", 1, 8, accelerator="gpu")
    dp, calls = _one_step("dp", 2, 8, accelerator="gpu")
    # every replica ran its own copy of the weights, on its own device
    assert {c.weight_device for c in calls} == {torch.device("cuda", 0), torch.device("cuda", 1)}
    assert sorted(c.size for c in calls) == [4, 4]
    for name in single:
        torch.testing.assert_close(dp[name], single[name], rtol=1e-5, atol=1e-5, msg=name)


# -- the protocol, from the command line: a LightningModule without it, refused before any process starts ----
LIGHTNING_DEMO = ["~model", "~data", "+data._target_=lightning.pytorch.demos.boring_classes.BoringDataModule",
                  "callbacks=none", "optimized_metric=null", "extras.print_config=false", "trainer.accelerator=cpu"]


@pytest.mark.parametrize("model", ["BoringModel", "DemoModel"])
def test_a_lightning_module_without_the_protocol_is_refused_in_one_line(tmp_path, model):
    """``src/train.py trainer=dp`` with Lightning's demo modules: exit 2, one line naming every missing member
    of the protocol (src/engine/strategies/protocols.py) and the fix; no traceback, no rank, no run directory."""
    proc = run_entry("train", *LIGHTNING_DEMO, f"+model._target_=lightning.pytorch.demos.boring_classes.{model}",
                     "trainer=dp", f"hydra.run.dir={tmp_path}/run", timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = error_line(proc)
    assert (f"trainer=dp needs model_step(batch) -> dict, record_step(stage, out) -> loss; "
            f"{model} lacks model_step, record_step; fix: subclass src.engine.steps.step_module.StepModule") in line, line
    assert "Initializing distributed" not in proc.stdout + proc.stderr
    assert not (tmp_path / "run").exists()
