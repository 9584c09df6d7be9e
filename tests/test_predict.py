"""``src/predict.py``: a checkpoint's predictions on a split, a folder of images or a tensor file, one CSV row
per input in input order; the same rows under DDP x2; bad input in one line with nothing written."""

from __future__ import annotations

import csv
import re
import sys
from pathlib import Path

import pytest
import torch
from torchvision.io import write_png

from src.data.mnist_datamodule import FashionMNISTDataModule
from src.eval import evaluate
from src.predict import predict
from src.train import train
from tests.helpers.config import ROOT, compose_cfg
from tests.helpers.entry import run_entry
from tests.helpers.training_runs import launch

FULL_TEST = ["++trainer.limit_test_batches=1.0"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """A short training run of the default MLP on Fashion-MNIST."""
    out = tmp_path_factory.mktemp("trained")
    _, objects = train(compose_cfg("train", ["test=false", "++trainer.limit_train_batches=20"], out))
    return objects["trainer"].checkpoint_callback.best_model_path


def rows(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def predicted(tmp_path: Path, checkpoint: str, *overrides: str) -> tuple[dict, list[dict]]:
    metrics, objects = predict(compose_cfg("predict", [f"ckpt_path={checkpoint}", *overrides], tmp_path))
    return metrics, rows(objects["writer"].path)


def test_test_split_predictions_give_evals_accuracy(tmp_path, checkpoint):
    metrics, table = predicted(tmp_path / "predict", checkpoint, "input=test")
    tested, _ = evaluate(compose_cfg("eval", [f"ckpt_path={checkpoint}", *FULL_TEST], tmp_path / "eval"))
    assert len(table) == 10_000 and [r["source"] for r in table[:2]] == ["test[0]", "test[1]"]
    assert metrics["predict/acc"] == pytest.approx(float(tested["test/acc"]), abs=1e-6)
    assert metrics["predict/acc"] == pytest.approx(sum(r["predicted"] == r["label"] for r in table) / len(table))
    first = [float(table[0][f"p_{k}"]) for k in range(10)]
    assert sum(first) == pytest.approx(1.0, abs=1e-4) and int(table[0]["predicted"]) == first.index(max(first))


def test_a_folder_of_images_and_a_tensor_file_predict_like_the_split(tmp_path, checkpoint):
    dm = FashionMNISTDataModule(data_dir=str(ROOT / "data"))
    dm.prepare_data()
    images = dm.load_split(train=False)[0][:3]  # uint8 (3, 1, 28, 28)
    folder = tmp_path / "images"
    folder.mkdir()
    for i, image in enumerate(images):
        write_png(image, str(folder / f"{i}.png"))
    write_png(images[0].expand(3, -1, -1).contiguous(), str(folder / "rgb.png"))  # converted to one channel
    torch.save(images.squeeze(1), tmp_path / "images.pt")  # (N, H, W): one channel implied
    _, split = predicted(tmp_path / "split", checkpoint, "input=test")
    _, from_files = predicted(tmp_path / "folder", checkpoint, f"input={folder}")
    _, from_tensor = predicted(tmp_path / "tensor", checkpoint, f"input={tmp_path / 'images.pt'}")
    assert [r["source"] for r in from_files] == ["0.png", "1.png", "2.png", "rgb.png"]
    assert [r["source"] for r in from_tensor] == ["images.pt[0]", "images.pt[1]", "images.pt[2]"]
    # the same images, in batches of other sizes: equal up to float rounding
    probabilities = [[float(r[f"p_{k}"]) for k in range(10)] for r in (*split[:3], *from_files[:3], *from_tensor)]
    for same in (probabilities[3:6], probabilities[6:]):
        assert all(a == pytest.approx(b, rel=1e-4, abs=1e-7) for a, b in zip(probabilities[:3], same, strict=True))
    assert [r["predicted"] for r in from_files] == [r["predicted"] for r in (*split[:3], split[0])]
    assert all(r["label"] == "" for r in (*from_files, *from_tensor))


@pytest.mark.parametrize(("make", "says"), [
    (lambda d: (d / "broken.png").write_bytes(b"not an image") and d, r"cannot read the image .*broken\.png"),
    (lambda d: torch.save(torch.zeros(2, 3, 28, 28, dtype=torch.uint8), d / "x.pt") or d / "x.pt",
     r"holds a tensor of shape \(2, 3, 28, 28\); fix: give images of shape \(N, 1, 28, 28\)"),
    (lambda d: d, "holds no PNG or JPEG file"),
    (lambda d: torch.save(torch.zeros(0, 1, 28, 28, dtype=torch.uint8), d / "none.pt") or d / "none.pt",
     r"none\.pt holds no images \(shape \(0, 1, 28, 28\)\); fix: give at least one image"),
], ids=["unreadable-image", "wrong-shape", "empty-folder", "no-images"])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, checkpoint, capsys, make, says):
    source = tmp_path / "in"
    source.mkdir()
    given = make(source)
    cfg = compose_cfg("predict", [f"ckpt_path={checkpoint}", f"input={given}"], tmp_path / "run")
    with pytest.raises(SystemExit) as exit_info:
        predict(cfg)
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert exit_info.value.code == 2 and len(errors) == 1 and re.search(says, errors[0]), errors
    assert "; fix: " in errors[0] and not list((tmp_path / "run").glob("predictions*"))


def refused(cfg, capsys) -> str:
    """The one ``error:`` line of a refused ``predict(cfg)`` (exit 2)."""
    with pytest.raises(SystemExit) as exit_info:
        predict(cfg)
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert exit_info.value.code == 2 and len(errors) == 1, errors
    return errors[0]


@pytest.mark.parametrize(("overrides", "fix"), [
    (["input=val", "seed=7"], "fix: add data.seed=12345"),
    (["input=train", "data.val_size=1000"], "fix: add data.val_size=5000"),
    (["input=val", "data.n_folds=5", "data.fold=2"], "fix: add data.n_folds=null"),
], ids=["another-seed", "another-val-size", "k-fold"])
def test_a_split_made_otherwise_than_in_training_is_refused(tmp_path, checkpoint, capsys, overrides, fix):
    """Its "validation" rows would hold samples the model trained on."""
    error = refused(compose_cfg("predict", [f"ckpt_path={checkpoint}", *overrides], tmp_path), capsys)
    assert "was trained on the split of n_folds=None, val_size=5000, seed=12345" in error and error.endswith(fix)
    assert not list(tmp_path.glob("predictions*"))


def test_fewer_inputs_than_ranks_are_refused_before_any_rank_starts(tmp_path, checkpoint, capsys):
    torch.save(torch.zeros(1, 1, 28, 28, dtype=torch.uint8), tmp_path / "one.pt")
    cfg = compose_cfg("predict", [f"ckpt_path={checkpoint}", f"input={tmp_path / 'one.pt'}", "trainer=ddp",
                                  "trainer.devices=2", "trainer.accelerator=cpu"], tmp_path / "run")
    assert refused(cfg, capsys).endswith("holds 1 input(s) for 2 ranks, and each rank predicts at least one; "
                                         "fix: predict with at most 1 device(s), e.g. trainer.devices=1")


@pytest.mark.parametrize("earlier", ["checkpoints/last.ckpt", "predictions.csv"])
def test_an_earlier_runs_dir_is_refused_before_hydra_writes_to_it(tmp_path, earlier):
    """A training run's checkpoints, or an earlier prediction: neither they nor that run's .hydra/ record change."""
    run = tmp_path / "earlier"
    saved = {run / earlier: b"earlier output", run / ".hydra" / "config.yaml": b"earlier record"}
    for path, content in saved.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
    proc = run_entry("predict", f"ckpt_path={tmp_path / 'any.ckpt'}", f"hydra.run.dir={run}")
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
    assert f"holds an earlier run's {earlier.split('/')[0]}" in errors[0] and errors[0].endswith("pick a new hydra.run.dir")
    assert {path: path.read_bytes() for path in saved} == saved
    assert sorted(p.relative_to(run).as_posix() for p in run.rglob("*") if p.is_file()) == sorted(
        p.relative_to(run).as_posix() for p in saved)


def test_a_checkpoint_of_another_task_is_refused(tmp_path, checkpoint, capsys):
    cfg = compose_cfg("predict", [f"ckpt_path={checkpoint}", "model=toy", "data=toy"], tmp_path)
    with pytest.raises(SystemExit):
        predict(cfg)
    assert "does not fit this model" in capsys.readouterr().err


@pytest.mark.slow
def test_ddp_predictions_are_the_one_process_rows(tmp_path, checkpoint):
    tables = []
    for name, launch_args in (("one", []), ("ddp", ["trainer=ddp", "trainer.devices=2"])):
        run_dir = tmp_path / name
        proc = launch([sys.executable, str(ROOT / "src" / "predict.py"), f"ckpt_path={checkpoint}", "input=val",
                       *launch_args, "trainer.accelerator=cpu", f"paths.log_dir={tmp_path}", f"hydra.run.dir={run_dir}"])
        assert proc.wait(timeout=300) == 0, (proc.stderr_file.seek(0), proc.stderr_file.read()[-3000:])
        tables.append(rows(run_dir / "predictions.csv"))
    one, ddp = tables
    assert len(one) == len(ddp) == 5000
    assert [(r["source"], r["predicted"], r["label"]) for r in one] == [(r["source"], r["predicted"], r["label"])
                                                                          for r in ddp]
    assert all(abs(float(a[f"p_{k}"]) - float(b[f"p_{k}"])) < 1e-5 for a, b in zip(one, ddp, strict=True)
               for k in range(10))
