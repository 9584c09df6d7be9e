"""The default run prints nothing the user can't act on, and keeps every warning about their config (issue 13)."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from lightning import LightningModule
from lightning.pytorch.utilities.model_summary import summarize
from torch import nn

from src.engine.callbacks.model_summary import RichModelSummary
from src.engine.utils.job_setup import QuietLibraries, _drop_lightning_tip
from tests.helpers.entry import run_entry


@pytest.mark.slow
def test_default_run_is_quiet_but_keeps_config_warnings(tmp_path):
    proc = run_entry("train", "trainer.max_epochs=1", "+trainer.limit_train_batches=2",
                     "+trainer.limit_val_batches=2", "+trainer.limit_test_batches=2", "extras.print_config=false",
                     f"paths.log_dir={tmp_path}")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "LeafSpec" not in out  # Lightning's own use of a torch API it has not caught up with
    assert "FLOPs" not in out  # not measured (no example_input_array), so not shown as 0
    assert "Tip:" not in out  # Lightning's advertisement for its cloud logger
    assert "Total params" in out  # the model summary itself is still there
    # A warning about the user's own settings stays: 2 batches < log_every_n_steps=50.
    assert "smaller than the logging interval" in out


class _Net(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 4)
        self.example_input_array = torch.zeros(2, 8)

    def forward(self, x):
        return self.layer(x)


def _summary_text(module: LightningModule, capsys) -> str:
    s = summarize(module, max_depth=1)
    RichModelSummary.summarize(s._get_summary_data(), s.total_parameters, s.trainable_parameters, s.model_size,
                               s.total_training_modes, getattr(s, "total_flops", 0))  # lightning 2.5 counts none
    return capsys.readouterr().out


@pytest.mark.fast
def test_flops_shown_only_when_measured(capsys):
    if hasattr(summarize(_Net(), max_depth=1), "total_flops"):  # Lightning counts FLOPs from 2.6 on
        measured = _summary_text(_Net(), capsys)
        assert "Total FLOPs: 128" in measured and "FLOPs" in measured.splitlines()[1]  # 2 x (8x4) multiply-adds

    unmeasured = _Net()
    unmeasured.example_input_array = None
    text = _summary_text(unmeasured, capsys)
    assert "FLOPs" not in text
    assert "Total params: 36" in text and "In sizes" not in text


@pytest.mark.fast
def test_library_warnings_filtered_others_kept(monkeypatch):
    from lightning.pytorch.utilities._pytree import _tree_flatten

    monkeypatch.delenv("PYTHONWARNINGS", raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        QuietLibraries().on_job_start(config=None)
        _tree_flatten([1, 2])  # builds a LeafSpec inside Lightning: torch's FutureWarning
        warnings.warn("a FutureWarning from anywhere else", FutureWarning, stacklevel=1)
    logging.getLogger("lightning.pytorch.utilities.rank_zero").removeFilter(_drop_lightning_tip)
    assert [str(w.message) for w in caught] == ["a FutureWarning from anywhere else"]
    # ranks started with `spawn` are fresh interpreters: they read the same filter from the environment
    import os

    assert os.environ["PYTHONWARNINGS"] == (
        "ignore:`isinstance(treespec:FutureWarning:lightning.pytorch.utilities._pytree"
    )
