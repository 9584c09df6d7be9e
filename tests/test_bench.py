"""The benchmark harness runs end to end, and the speed fixes keep the metrics exactly as they were."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from src.models.step_module import StepModule
from src.strategies.lightning_compat import cheap_cuda_check_without_gpus
from src.train import train
from tests.helpers.config import ROOT


def _log_every_step(self, name, metric, prog_bar=True):
    """What ``record_step`` did before ``log_epoch_metric``: ``self.log`` the metric on every step."""
    self.log(name, metric, on_step=False, on_epoch=True, prog_bar=prog_bar)


@pytest.mark.slow
def test_logging_metrics_once_per_epoch_gives_the_same_values(make_cfg, monkeypatch):
    overrides = ["trainer.max_epochs=2", "++trainer.limit_val_batches=3", "++trainer.limit_test_batches=3"]
    once, _ = train(make_cfg("train", overrides, subdir="once"))
    monkeypatch.setattr(StepModule, "log_epoch_metric", _log_every_step)
    every, _ = train(make_cfg("train", overrides, subdir="every"))
    keys = [k for k in every if k.split("/")[0] in ("train", "val", "test") and "best" not in k]
    assert {"train/loss", "train/acc", "val/loss", "val/acc", "test/loss", "test/acc"} <= set(keys)
    for key in keys:
        assert float(once[key]) == float(every[key]), key


@pytest.mark.fast
def test_runtime_cuda_check_only_without_gpus(monkeypatch):
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cheap_cuda_check_without_gpus()
    assert os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] == "1"  # GPUs: keep Lightning's fork-safe check
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cheap_cuda_check_without_gpus()
    assert os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] == "0"


@pytest.mark.slow
def test_bench_writes_table_json_and_plots(tmp_path):
    """Minimal steps, one round: checks the outputs exist and hold positive numbers (no timing asserted)."""
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "scripts.bench", "--suite", "throughput,startup",
           "--rounds", "1", "--epochs", "2", "--limit-train-batches", "5", "--workers", "0", "--quiet-wait", "0",
           "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]

    md = (out / "results.md").read_text()
    assert "| project |" in md and "| plain loop |" in md and "| per-sample, 0 workers |" in md
    assert "| bare Lightning |" in md
    data = json.loads((out / "results.json").read_text())
    suites = {s["name"]: s for s in data["suites"]}
    tput = suites["throughput"]["raw"]
    for name in ("project", "plain loop", "bare Lightning", "per-sample, 0 workers"):
        assert tput["samples_per_s"][name][0] > 0, name
        assert tput["peak_rss_mb"][name][0] > 0, name
    assert tput["bare_lightning_over_plain"] > 0 and tput["project_over_bare_lightning"] > 0
    assert [len(tput["paired_steps"][name]) for name in ("bare", "project")] == [1, 1]  # one round each
    assert "Paired steps" in md
    assert tput["data_ms_per_batch"] > 0
    startup = suites["startup"]["raw"]
    for name in ("project", "plain loop"):
        assert 0 < startup["first_step_s"][name][0] < startup["exit_s"][name][0], name
    for png in ("throughput.png", "startup.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.fast
def test_plug_in_suites_say_when_their_benchmark_is_missing(tmp_path, monkeypatch):
    from scripts.bench.context import Bench
    from scripts.bench.suites import collectives

    monkeypatch.setattr(collectives, "ENTRY", tmp_path / "missing.py")
    result = collectives.run(Bench(tmp_path, None))
    assert not result.rows and result.notes[0].startswith("not available")


@pytest.mark.fast
def test_bench_rejects_bad_options():
    proc = subprocess.run([sys.executable, "-m", "scripts.bench", "--suite", "throughput,nope"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown suite(s) nope" in proc.stderr
