"""`python src/export.py`: every model config exports to ONNX and TorchScript, and the exported files give the
checkpoint model's outputs within 1e-4 when loaded back with onnxruntime and torch.jit.load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from src.engine.checkpointing.io import load_checkpoint_file
from tests.helpers.entry import run_entry

onnxruntime = pytest.importorskip("onnxruntime", reason="the export extra: pip install -e '.[export]'")

# model config -> the data config it trains on
PAIRS = {"mlp": ["data=fashion_mnist"], "resnet18": ["data=cifar10"], "toy": ["data=toy"]}


def trained_checkpoint(make_cfg, model: str, data: list[str], *extra: str) -> Path:
    from src.train import train

    _, objects = train(make_cfg("train", [f"model={model}", *data, "test=false", "++trainer.limit_train_batches=1",
                                          "++trainer.limit_val_batches=1", *extra], subdir="train"))
    return Path(objects["trainer"].checkpoint_callback.best_model_path)


def loaded_model(make_cfg, ckpt: Path, model: str, data: list[str]) -> torch.nn.Module:
    """The checkpoint's model, built from its config and loaded as a user would, in eval mode."""
    import hydra

    cfg = make_cfg("export", [f"ckpt_path={ckpt}", f"model={model}", *data], subdir="reference", tiny=False)
    module = hydra.utils.instantiate(cfg.model)
    module.load_state_dict(load_checkpoint_file(ckpt)["state_dict"])
    return module.eval()


def exported_outputs(path: Path, fmt: str, batch: torch.Tensor) -> torch.Tensor:
    if fmt == "onnx":
        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        return torch.from_numpy(session.run(None, {session.get_inputs()[0].name: batch.numpy()})[0])
    with torch.no_grad():
        return torch.jit.load(str(path))(batch)


@pytest.mark.slow
@pytest.mark.parametrize("model", list(PAIRS))
def test_every_model_exports_to_onnx_and_torchscript(make_cfg, synthetic_cifar10, model):
    from src.export import export

    data = [*PAIRS[model], *([f"data.data_dir={synthetic_cifar10}", "data.verify_checksums=false",
                              "data.val_size=100"] if model == "resnet18" else [])]
    ckpt = trained_checkpoint(make_cfg, model, data)
    reference = loaded_model(make_cfg, ckpt, model, data)
    for fmt, suffix in (("onnx", ".onnx"), ("torchscript", ".pt")):
        cfg = make_cfg("export", [f"ckpt_path={ckpt}", f"model={model}", *data, f"format={fmt}",
                                  "extras.print_config=false"], subdir=f"export-{fmt}", tiny=False)
        result, _ = export(cfg)
        assert Path(result["output"]) == ckpt.with_suffix(suffix) and ckpt.with_suffix(suffix).is_file()
        batch = _batch_like(model)
        with torch.no_grad():
            expected = reference(batch)
        got = exported_outputs(ckpt.with_suffix(suffix), fmt, batch)
        assert got.shape == expected.shape and (got - expected).abs().max() < 1e-4, fmt


def _batch_like(model: str) -> torch.Tensor:
    """A batch of a size the export was not traced with (7): the batch dimension must stay free."""
    shape = {"mlp": (1, 28, 28), "resnet18": (3, 32, 32), "toy": (10,)}[model]
    return torch.randn(7, *shape)


@pytest.mark.slow
def test_a_dp_checkpoint_exports_like_any_other(make_cfg):
    """dp (and ddp, pipeline) checkpoints hold the unsplit model: it exports without any conversion."""
    from src.export import export

    ckpt = trained_checkpoint(make_cfg, "mlp", PAIRS["mlp"], "trainer=dp", "trainer.devices=2")
    result, _ = export(make_cfg("export", [f"ckpt_path={ckpt}", "extras.print_config=false"], subdir="export",
                                tiny=False))
    assert result["max_difference"] < 1e-4 and Path(result["output"]).is_file()


def test_export_without_a_checkpoint_or_with_an_unknown_format_is_one_line(tmp_path):
    proc = run_entry("export", f"hydra.run.dir={tmp_path}/run")
    assert proc.returncode == 2 and "ckpt_path is not set" in proc.stderr
    proc = run_entry("export", "ckpt_path=x.ckpt", "format=tflite", f"hydra.run.dir={tmp_path}/run2")
    assert proc.returncode == 2 and "format='tflite' is not one of onnx, torchscript" in proc.stderr


@pytest.mark.slow
def test_an_export_that_does_not_match_is_removed(make_cfg, monkeypatch):
    """A file whose outputs differ from the checkpoint's model by more than the tolerance is not left behind."""
    import src.export

    ckpt = trained_checkpoint(make_cfg, "mlp", PAIRS["mlp"])
    monkeypatch.setattr(src.export, "max_difference", lambda *args: 1.0)
    cfg = make_cfg("export", [f"ckpt_path={ckpt}", "format=torchscript", "extras.print_config=false"],
                   subdir="export", tiny=False)
    with pytest.raises(RuntimeError, match="torchscript export differs from the checkpoint's model by 1"):
        src.export.export(cfg)
    assert not ckpt.with_suffix(".pt").exists() and ckpt.is_file()
