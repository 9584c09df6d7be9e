"""Export a trained checkpoint for deployment: ONNX (onnxruntime, serving stacks) or TorchScript.

    python src/export.py ckpt_path=logs/train/runs/<run>/checkpoints/last.ckpt                  # -> last.onnx
    python src/export.py ckpt_path=... format=torchscript                                       # -> last.pt
    python src/export.py ckpt_path=... data=cifar10 model=resnet18 output=resnet18.onnx

Checkpoints of every strategy (single device, dp, ddp, pipeline) hold the full, unsplit model, so each
exports the same way; an fsdp folder of shards is first read whole into this process. The model is traced in eval mode with a batch of the data config's input shape;
the ONNX file keeps the batch dimension dynamic. The export is checked against the checkpoint's model
on a batch of another size before it is written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import rootutils

# the project root on sys.path and in PROJECT_ROOT; .env is loaded by LoadDotenv (src/engine/utils/job_setup.py)
rootutils.setup_root(__file__, indicator=".project-root", pythonpath=True, dotenv=False)

from src.engine import prompt_exit

if __name__ == "__main__":
    prompt_exit.install()  # before the imports below register their atexit handlers: it must run after them

import hydra
import lightning as L
import torch
from omegaconf import DictConfig

from src.engine import (
    ConfigError,
    RankedLogger,
    check_checkpoint,
    extras,
    hydra_main,
    isolated_job,
    load_checkpoint_file,
    require_ckpt_path,
    task_wrapper,
)

log = RankedLogger(__name__)
FORMATS = {"onnx": ".onnx", "torchscript": ".pt"}
# the export must give the checkpoint model's outputs within this: absolute, or relative where an output exceeds 1
TOLERANCE = 1e-4


def check_export_config(cfg: DictConfig) -> None:
    require_ckpt_path(cfg, "export.py", "export")
    if cfg.get("format") not in FORMATS:
        raise ConfigError(f"format={cfg.get('format')!r} is not one of {', '.join(FORMATS)}; fix: e.g. format=onnx")


@task_wrapper
def export(cfg: DictConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """Load ``cfg.ckpt_path`` into the configured model and write it in ``cfg.format``; returns the file and
    the largest difference from the checkpoint's model on a check batch."""
    check_export_config(cfg)
    datamodule: L.LightningDataModule = hydra.utils.instantiate(cfg.data)
    model: L.LightningModule = hydra.utils.instantiate(cfg.model)
    check_checkpoint(cfg.ckpt_path, model, cfg)
    model.load_state_dict(load_checkpoint_file(Path(cfg.ckpt_path))["state_dict"])
    model.eval()
    ckpt = Path(cfg.ckpt_path)
    output = Path(cfg.output) if cfg.get("output") else ckpt.with_suffix(FORMATS[cfg.format])
    output.parent.mkdir(parents=True, exist_ok=True)
    shape = input_shape(model, datamodule)
    sample = torch.randn(2, *shape)
    if cfg.format == "onnx":
        model.to_onnx(output, sample, input_names=["input"], output_names=["output"],
                      dynamic_shapes=({0: torch.export.Dim("batch")},))
    else:
        torch.jit.save(model.to_torchscript(method="trace", example_inputs=sample), output)
    difference = max_difference(output, cfg.format, model, torch.randn(5, *shape))
    if difference > TOLERANCE:
        output.unlink(missing_ok=True)
        raise RuntimeError(f"the {cfg.format} export differs from the checkpoint's model by {difference:.3g}")
    log.info(f"Exported {ckpt} to {output} ({cfg.format}); it matches the model within {difference:.2g}")
    return {"output": str(output), "max_difference": difference}, {"cfg": cfg, "model": model}


def input_shape(model: L.LightningModule, datamodule: L.LightningDataModule) -> tuple[int, ...]:
    """One sample's shape: the module's ``example_input_array``, the data module's ``input_shape``, or the inputs
    of its first test batch; one line when none of them gives it."""
    example = getattr(model, "example_input_array", None)
    if isinstance(example, torch.Tensor):
        return tuple(example.shape[1:])
    if hasattr(datamodule, "input_shape"):
        return tuple(datamodule.input_shape)
    batch = first_test_batch(datamodule)
    inputs = batch[0] if isinstance(batch, (list, tuple)) and batch else batch
    if isinstance(inputs, torch.Tensor) and inputs.dim() >= 1:
        return tuple(inputs.shape[1:])
    raise ConfigError(f"export.py needs one input's shape, and {type(model).__name__} has no example_input_array "
                      f"(one tensor) while {type(datamodule).__name__} has no input_shape and no test batch of "
                      "tensors; fix: set self.example_input_array = torch.zeros(1, ...) in the module's __init__")


def first_test_batch(datamodule: L.LightningDataModule) -> object:
    """The first batch of the data module's test loader, or None where it has none."""
    try:
        datamodule.prepare_data()
        datamodule.setup("test")
        return next(iter(datamodule.test_dataloader()))
    except (NotImplementedError, AttributeError, StopIteration, TypeError):
        return None


def max_difference(path: Path, fmt: str, model: L.LightningModule, batch: torch.Tensor) -> float:
    """The largest difference between the exported file's outputs and ``model``'s on ``batch``: absolute, and
    relative to the output where it exceeds 1 (float32 rounding grows with the values)."""
    with torch.no_grad():
        expected = model(batch)
    if fmt == "onnx":
        import onnxruntime

        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        got = torch.from_numpy(session.run(None, {session.get_inputs()[0].name: batch.numpy()})[0])
    else:
        with torch.no_grad():
            got = torch.jit.load(str(path))(batch)
    return float(((got - expected).abs() / expected.abs().clamp(min=1)).max())


@hydra_main(version_base="1.3", config_path="../configs", config_name="export.yaml")  # config errors: 1 line
def main(cfg: DictConfig) -> None:
    with isolated_job():
        check_export_config(cfg)  # before extras prints the config, which holds it
        extras(cfg)
        export(cfg)


if __name__ == "__main__":
    with prompt_exit.exit_code_recorded():  # then end without the interpreter's teardown
        main()
