"""GPU paths through the real configs and entry points, split by the number of GPUs they need.

Every test but the first is marked ``gpu`` and skips without enough CUDA GPUs (``pytest -m gpu -rs``). The
first checks on the CPU the decision the GPU data path relies on: ``data.pin_memory=auto`` pins on a GPU.
Related GPU tests live beside their CPU twins: tests/test_randomness.py (per-rank streams on 2 GPUs),
tests/test_dp.py, tests/test_ddp.py and tests/test_collectives.py.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning import Callback, LightningModule, Trainer
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator
from torch import nn

from src.data.mnist_datamodule import MNISTDataModule
from src.engine.utils.errors import ConfigError
from tests.helpers.entry import run_entry
from tests.helpers.run_if import gpu_test
from tests.test_compile import assert_compiled_run_round_trips, compiled_fit_resume_eval

GPU = ["trainer=gpu", "trainer.accelerator=gpu"]  # after the tiny configs' forced CPU, so these win
PROBE = ["+callbacks.probe._target_=tests.test_gpu.DeviceProbe"]
PRECISION_DTYPES = {"32-true": torch.float32, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.SyncBatchNorm)


class DeviceProbe(Callback):
    """Test-only: where the first training batch, the parameters and each stage's first layer ran, in what dtype.

    ``first_layer``: the output dtype and device of the net's first Linear/Conv2d per stage (``train``,
    ``validate``, ``test``...). ``batchnorm_devices``: the devices BatchNorm layers saw in training; under
    dp the replicas share the root's hook dicts, so every replica reports here.
    """

    def __init__(self, hook_layers: bool = True) -> None:
        self.hook_layers = hook_layers
        self.seen: dict[str, object] = {}
        self.first_layer: dict[str, tuple[torch.dtype, torch.device]] = {}
        self.batchnorm_devices: set[torch.device] = set()

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if not self.hook_layers or self.first_layer or stage != "fit":
            return
        self.trainer = trainer
        next(m for m in pl_module.net.modules() if isinstance(m, (nn.Linear, nn.Conv2d))).register_forward_hook(
            self.record_first_layer)
        for norm in (m for m in pl_module.net.modules() if isinstance(m, NORMS)):
            norm.register_forward_hook(self.record_batchnorm)

    def record_first_layer(self, module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        self.first_layer.setdefault(self.trainer.state.stage.value, (output.dtype, output.device))

    def record_batchnorm(self, module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        if module.training:
            self.batchnorm_devices.add(inputs[0].device)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        if "param_devices" not in self.seen:
            self.seen.update(param_devices={p.device for p in pl_module.parameters()},
                             batch_devices={t.device for t in batch}, input_dtype=batch[0].dtype,
                             loader_pins=trainer.train_dataloader.pin_memory)


def probe_of(objects: dict) -> DeviceProbe:
    return next(cb for cb in objects["callbacks"] if isinstance(cb, DeviceProbe))


def assert_finite(metrics: dict, *keys: str) -> None:
    for key in keys:
        assert key in metrics and torch.isfinite(torch.as_tensor(metrics[key])).all(), (key, metrics.get(key))


def skip_without_bf16(precision: str) -> None:
    if precision.startswith("bf16") and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bfloat16")


# -- on the CPU: the pin_memory decision ------------------------------------------------------------------


@pytest.mark.fast
def test_pin_memory_auto_pins_only_on_a_gpu():
    dm = MNISTDataModule()
    assert dm.hparams.pin_memory == "auto" and dm.pin_memory is False  # no trainer yet
    dm.trainer = SimpleNamespace(accelerator=CPUAccelerator())
    assert dm.pin_memory is False
    dm.trainer = SimpleNamespace(accelerator=CUDAAccelerator())
    assert dm.pin_memory is True
    forced = MNISTDataModule(pin_memory=False)
    forced.trainer = SimpleNamespace(accelerator=CUDAAccelerator())
    assert forced.pin_memory is False and MNISTDataModule(pin_memory=True).pin_memory is True
    with pytest.raises(ConfigError, match="data.pin_memory='yes' is not true, false or auto"):
        MNISTDataModule(pin_memory="yes")


@pytest.mark.fast
def test_pin_memory_follows_the_trainer(make_cfg):
    import hydra

    data_cfg = make_cfg("train").data
    dm = hydra.utils.instantiate(data_cfg)
    dm.trainer = Trainer(accelerator="cpu", devices=1, logger=False)
    assert data_cfg.pin_memory == "auto" and dm.pin_memory is False


# -- 1 GPU --------------------------------------------------------------------------------------------------


@gpu_test(1)
@pytest.mark.parametrize("precision", list(PRECISION_DTYPES))
def test_gpu_fit_and_test(make_cfg, precision):
    """`trainer=gpu` fit + test in each precision: finite metrics, parameters on the GPU, the precision applied."""
    from src.train import train

    skip_without_bf16(precision)
    metrics, objects = train(make_cfg("train", [*GPU, f"trainer.precision={precision}", *PROBE]))
    assert_finite(metrics, "train/loss", "val/loss", "val/acc", "test/loss", "test/acc")
    probe = probe_of(objects)
    assert {d.type for d in probe.seen["param_devices"]} == {"cuda"}
    for stage in ("train", "validate", "test"):
        assert probe.first_layer[stage] == (PRECISION_DTYPES[precision], torch.device("cuda", 0)), stage


@gpu_test(1)
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_the_direct_owned_step_equals_lightnings_calls_on_gpu(make_cfg, precision):
    """The owned step's direct backward and optimizer call (the default on a GPU: ``DIRECT_STEP_DEVICES``)
    against Lightning's calls, eager (no capture), on the GPU."""
    from src.engine.steps import owned_step
    from tests.test_owned_step import assert_direct_step_equals_lightnings_calls

    skip_without_bf16(precision)
    assert "cuda" in owned_step.DIRECT_STEP_DEVICES
    assert_direct_step_equals_lightnings_calls(make_cfg, "callback", *GPU, f"trainer.precision={precision}",
                                               "model.step_capture=false")


@gpu_test(1)
def test_dp_on_one_gpu_validates_under_autocast(make_cfg):
    """`trainer=dp trainer.devices=1` in mixed precision: training, validation and test all run autocast on the GPU."""
    from src.engine.strategies.dp import DataParallelStrategy
    from src.train import train

    precision = "bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"
    overrides = ["trainer=dp", "trainer.devices=1", "trainer.accelerator=gpu", f"trainer.precision={precision}"]
    metrics, objects = train(make_cfg("train", [*overrides, *PROBE]))
    assert isinstance(objects["trainer"].strategy, DataParallelStrategy)
    assert_finite(metrics, "train/loss", "val/loss", "val/acc", "test/loss", "test/acc")
    probe = probe_of(objects)
    for stage in ("train", "validate", "test"):
        assert probe.first_layer[stage] == (PRECISION_DTYPES[precision], torch.device("cuda", 0)), stage


@gpu_test(1)
def test_compiled_run_resumes_and_evaluates_on_gpu(make_cfg):
    """model.compile=true with the default backend (inductor) on the GPU: fit, resume from last.ckpt, eval."""
    run = compiled_fit_resume_eval(make_cfg, *GPU, fit_only=(*PROBE, "+callbacks.probe.hook_layers=false"))
    assert_compiled_run_round_trips(run)
    probe = next(cb for cb in run["callbacks"] if isinstance(cb, DeviceProbe))
    assert {d.type for d in probe.seen["param_devices"]} == {"cuda"}


@gpu_test(1)
def test_data_path_on_gpu(make_cfg):
    """The data set lives on the GPU, normalized once; a batch is indexed and augmented there, no copy per step."""
    from src.train import train

    metrics, objects = train(make_cfg("train", [*GPU, "data.augment=true", *PROBE]))
    assert_finite(metrics, "train/loss", "test/acc")
    seen = probe_of(objects).seen
    assert {d.type for d in seen["batch_devices"]} == {"cuda"}
    assert seen["input_dtype"] == torch.float32 and seen["loader_pins"] is False  # nothing to pin or copy
    dm = objects["datamodule"]
    assert dm.data_device == torch.device("cuda", 0)
    assert all(ds.inputs.is_cuda and ds.inputs.dtype == torch.float32 for ds in (dm.data_train, dm.data_test))
    assert dm.augmentation_generator(torch.device("cuda", 0)).device.type == "cuda"


@gpu_test(1)
def test_pinned_data_path_on_gpu(make_cfg):
    """data.on_device=false (or data too large): uint8 batches come from pinned host memory, reach the GPU, and
    are normalized and augmented there."""
    from src.train import train

    metrics, objects = train(make_cfg("train", [*GPU, "data.augment=true", "data.on_device=false", *PROBE]))
    assert_finite(metrics, "train/loss", "test/acc")
    seen = probe_of(objects).seen
    assert {d.type for d in seen["batch_devices"]} == {"cuda"}
    assert seen["input_dtype"] == torch.float32  # the uint8 batch was transformed after the transfer
    assert seen["loader_pins"] is True
    dm = objects["datamodule"]
    assert dm.data_device is None and dm.data_train.inputs.dtype == torch.uint8
    assert dm.pin_memory and next(iter(dm.train_dataloader()))[0].is_pinned()


class NoSyncWindow(Callback):
    """Test-only: training steps ``start + 1 .. start + steps`` of the first epoch run under
    ``torch.cuda.set_sync_debug_mode("error")``: any host-device sync in them (a blocking copy, ``.item()``,
    ``nonzero``...) raises where it happens, whichever callback, metric or loop it is in."""

    def __init__(self, start: int = 5, steps: int = 30) -> None:
        self.start, self.steps, self.checked = start, steps, 0

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        if trainer.current_epoch != 0:
            return
        if batch_idx == self.start:
            torch.cuda.set_sync_debug_mode("error")
        elif self.start < batch_idx <= self.start + self.steps:
            self.checked += 1
            if batch_idx == self.start + self.steps:
                torch.cuda.set_sync_debug_mode(0)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        torch.cuda.set_sync_debug_mode(0)


@gpu_test(1)
@pytest.mark.parametrize("workload", ["mlp", "mlp-pinned", "resnet18"])
def test_steady_steps_on_gpu_never_sync(make_cfg, synthetic_cifar10, workload):
    """The default callbacks, logger and metrics, in bf16-mixed: 30 steady steps without a host-device sync."""
    from src.train import train

    skip_without_bf16("bf16-mixed")
    data = {"mlp": ["data.augment=true"], "mlp-pinned": ["data.augment=true", "data.on_device=false"],
            "resnet18": ["data=cifar10", "model=resnet18", f"data.data_dir={synthetic_cifar10}",
                         "data.verify_checksums=false", "data.val_size=100", "data.batch_size=4"]}[workload]
    overrides = [*GPU, "trainer.precision=bf16-mixed", *data, "++trainer.limit_train_batches=40",
                 "+callbacks.no_sync._target_=tests.test_gpu.NoSyncWindow"]
    metrics, objects = train(make_cfg("train", overrides))
    assert_finite(metrics, "train/loss", "test/acc")
    assert next(cb for cb in objects["callbacks"] if isinstance(cb, NoSyncWindow)).checked == 30
    assert objects["model"].step_capture_counts[1] >= 30  # the default captures the step: replays were checked


# -- 2 GPUs -------------------------------------------------------------------------------------------------


@gpu_test(2)
def test_dp_on_two_gpus_with_batchnorm_and_validation(make_cfg):
    """`trainer=dp trainer.devices=2` with BatchNorm: both GPUs train, device 0's statistics reach the root,
    and one GPU evaluating the checkpoint reproduces dp's test metrics."""
    from src.eval import evaluate
    from src.train import train

    overrides = ["trainer=dp", "trainer.devices=2", "trainer.accelerator=gpu", "model.net.batch_norm=true"]
    metrics, objects = train(make_cfg("train", [*overrides, *PROBE], subdir="train"))
    assert_finite(metrics, "train/loss", "val/loss", "val/acc", "test/loss", "test/acc")
    probe = probe_of(objects)
    assert probe.batchnorm_devices == {torch.device("cuda", 0), torch.device("cuda", 1)}
    assert {d for d in probe.seen["param_devices"]} == {torch.device("cuda", 0)}  # the root's parameters
    ckpt = objects["trainer"].checkpoint_callback.best_model_path
    state = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
    assert state["net.fc0.2.running_mean"].abs().sum() > 0  # updated by the replica sharing the root's buffers
    single, _ = evaluate(make_cfg("eval", [*GPU, "model.net.batch_norm=true", f"ckpt_path={ckpt}"], subdir="eval"))
    assert single["test/loss"].item() == pytest.approx(metrics["test/loss"].item(), rel=1e-4)
    assert single["test/acc"].item() == pytest.approx(metrics["test/acc"].item(), abs=0.01)


class SaveLayerTypes(Callback):
    """Test-only: every rank of a real DDP run writes its BatchNorm layer types and backend at train start."""

    def __init__(self, dirpath: str) -> None:
        self.dirpath = Path(dirpath)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        norms = sorted({type(m).__name__ for m in pl_module.modules() if isinstance(m, NORMS)})
        self.dirpath.mkdir(parents=True, exist_ok=True)
        backend = torch.distributed.get_backend()
        device = str(next(pl_module.parameters()).device)
        (self.dirpath / f"rank{trainer.global_rank}.txt").write_text(f"{backend}\n{device}\n{','.join(norms)}\n")


@gpu_test(2)
def test_sync_batchnorm_converted_under_ddp(tmp_path):
    """`python src/train.py trainer=ddp trainer.sync_batchnorm=true`: every rank trains SyncBatchNorm layers over nccl."""
    proc = run_entry(
        "train", "trainer=ddp", "trainer.devices=2", "trainer.accelerator=gpu", "trainer.sync_batchnorm=true",
        "model.net.batch_norm=true", "trainer.max_epochs=1", "++trainer.limit_train_batches=4",
        "++trainer.limit_val_batches=2", "++trainer.limit_test_batches=2", "extras.print_config=false", "logger=csv",
        "+callbacks.layers._target_=tests.test_gpu.SaveLayerTypes", f"+callbacks.layers.dirpath={tmp_path}/layers",
        f"hydra.run.dir={tmp_path}/run", timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        backend, device, norms = (tmp_path / "layers" / f"rank{rank}.txt").read_text().split()
        assert (backend, device, norms) == ("nccl", f"cuda:{rank}", "SyncBatchNorm"), rank
