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

# the project root on sys.path and in PROJECT_ROOT; .env is loaded by LoadDotenv (src/utils/job_setup.py)
rootutils.setup_root(__file__, indicator=".project-root", pythonpath=True, dotenv=False)

from src.runtime import prompt_exit

if __name__ == "__main__":
    prompt_exit.install()  # before the imports below register their atexit handlers: it must run after them

import hydra
import lightning as L
import torch
from omegaconf import DictConfig

from src.checkpointing.io import load_checkpoint_file
from src.checkpointing.start import check_checkpoint, require_ckpt_path
from src.runtime.hydra_launch import isolated_job
from src.utils.errors import ConfigError
from src.utils.hydra_errors import hydra_main
from src.utils.pylogger import RankedLogger
from src.utils.task import extras, task_wrapper

log = RankedLogger(__name__)
FORMATS = {"onnx": ".onnx", "torchscript": ".pt"}
TOLERANCE = 1e-4  # the export must give the checkpoint model's outputs within this (max abs difference)


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
    sample = torch.randn(2, *datamodule.input_shape)
    if cfg.format == "onnx":
        model.to_onnx(output, sample, input_names=["input"], output_names=["output"],
                      dynamic_shapes=({0: torch.export.Dim("batch")},))
    else:
        torch.jit.save(model.to_torchscript(method="trace", example_inputs=sample), output)
    difference = max_difference(output, cfg.format, model, torch.randn(5, *datamodule.input_shape))
    if difference > TOLERANCE:
        output.unlink(missing_ok=True)
        raise RuntimeError(f"the {cfg.format} export differs from the checkpoint's model by {difference:.3g}")
    log.info(f"Exported {ckpt} to {output} ({cfg.format}); it matches the model within {difference:.2g}")
    return {"output": str(output), "max_difference": difference}, {"cfg": cfg, "model": model}


def max_difference(path: Path, fmt: str, model: L.LightningModule, batch: torch.Tensor) -> float:
    """The largest absolute difference between the exported file's outputs and ``model``'s on ``batch``."""
    with torch.no_grad():
        expected = model(batch)
    if fmt == "onnx":
        import onnxruntime

        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        got = torch.from_numpy(session.run(None, {session.get_inputs()[0].name: batch.numpy()})[0])
    else:
        with torch.no_grad():
            got = torch.jit.load(str(path))(batch)
    return float((got - expected).abs().max())


@hydra_main(version_base="1.3", config_path="../configs", config_name="export.yaml")  # config errors: 1 line
def main(cfg: DictConfig) -> None:
    with isolated_job():
        check_export_config(cfg)  # before extras prints the config, which holds it
        extras(cfg)
        export(cfg)


if __name__ == "__main__":
    with prompt_exit.exit_code_recorded():  # then end without the interpreter's teardown
        main()
