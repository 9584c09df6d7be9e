"""A checkpoint written by an earlier release still resumes, evaluates and exports.

``tests/fixtures/d541abd/mlp_step3.ckpt`` was written at commit d541abd (before the re-layout of
issue 48) by::

    python src/train.py model.net.hidden_sizes=[16] trainer.max_epochs=2 +trainer.max_steps=3 \
        +trainer.limit_train_batches=4 +trainer.limit_val_batches=2 last_ckpt_every_n_train_steps=3 \
        test=false logger=csv

the ``last.ckpt`` of the default Fashion-MNIST MLP that the fit saved when ``max_steps`` ended it, 3 of its first
epoch's 4 batches in (Lightning counts that epoch as done: a resume trains the next one). At d541abd,
``src/eval.py`` on it with ``+trainer.limit_test_batches=2`` gave ``test/acc`` 0.28125 and ``test/loss``
2.08487606048584: the same weights loaded now give the same numbers.
"""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers.config import ROOT
from tests.helpers.entry import run_entry

pytestmark = pytest.mark.slow

FIXTURE = ROOT / "tests" / "fixtures" / "d541abd" / "mlp_step3.ckpt"
SAME = ["model.net.hidden_sizes=[16]", "extras.print_config=false"]
AT_D541ABD = {"test/acc": 0.28125, "test/loss": 2.08487606048584}


def metrics(run: Path) -> dict[str, float]:
    (path,) = run.glob("csv/*/metrics.csv")
    with open(path, newline="") as f:
        (row,) = list(csv.DictReader(f))
    return {k: float(v) for k, v in row.items() if k.startswith("test/")}


def test_it_evaluates_to_the_numbers_it_gave_at_d541abd(tmp_path):
    proc = run_entry("eval", *SAME, "logger=csv", f"ckpt_path={FIXTURE}", "+trainer.limit_test_batches=2",
                     f"hydra.run.dir={tmp_path}/eval")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = metrics(tmp_path / "eval")
    assert got["test/acc"] == AT_D541ABD["test/acc"]
    assert got["test/loss"] == pytest.approx(AT_D541ABD["test/loss"], rel=1e-6)


def test_it_resumes_and_trains_the_next_epoch(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copy(FIXTURE, run / "checkpoints" / "last.ckpt")  # as a relaunch of that run finds it
    proc = run_entry("train", *SAME, "logger=csv", "trainer.max_epochs=2", "+trainer.limit_train_batches=4",
                     "+trainer.limit_val_batches=2", "last_ckpt_every_n_train_steps=3", "test=false",
                     f"hydra.run.dir={run}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Resuming this run from" in proc.stdout + proc.stderr
    last = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert (last["epoch"], last["global_step"]) == (2, 3 + 4)  # one more epoch of 4 batches
    old = torch.load(FIXTURE, weights_only=True)
    assert any(not torch.equal(last["state_dict"][k], old["state_dict"][k]) for k in old["state_dict"])


def test_it_exports(tmp_path):
    out = tmp_path / "model.onnx"
    proc = run_entry("export", *SAME, f"ckpt_path={FIXTURE}", f"output={out}", f"hydra.run.dir={tmp_path}/export")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out.stat().st_size > 0
