"""What this project wrote loads in every entry point; a crafted file runs no code in any of them.

The project's checkpoints hold tensors and plain values only (hyper-parameters are made plain before the
save), so they load with ``weights_only=True``. A file from elsewhere that holds Python objects is refused in
one line naming ``trust_checkpoint=true``; so is one whose stored config names a ``_target_`` this run's config
does not. Each crafted file carries a payload that would create a marker file: it must never appear.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch

from tests.helpers.entry import run_entry

pytestmark = pytest.mark.fast

TOY = ["model=toy", "data=toy", "extras.print_config=false", "logger=csv"]
TRAIN = [*TOY, "trainer.max_epochs=1", "+trainer.limit_train_batches=2", "+trainer.limit_val_batches=1",
         "++callbacks.metric_plot=null"]


class _Payload:
    """Unpickling it runs ``os.system``: what a crafted checkpoint does."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def project_checkpoint(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("toy") / "run"
    proc = run_entry("train", *TRAIN, "test=false", f"hydra.run.dir={run}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run / "checkpoints" / "last.ckpt"


def _entry_points(ckpt: Path, tmp_path: Path) -> dict[str, list[str]]:
    return {
        "eval": ["eval", *TOY, f"ckpt_path={ckpt}", f"hydra.run.dir={tmp_path}/eval"],
        "predict": ["predict", *TOY, f"ckpt_path={ckpt}", f"hydra.run.dir={tmp_path}/predict"],
        "export": ["export", "model=toy", "data=toy", "extras.print_config=false", f"ckpt_path={ckpt}",
                   f"output={tmp_path}/model.onnx", f"hydra.run.dir={tmp_path}/export"],
        "resume": ["train", *TRAIN, f"ckpt_path={ckpt}", f"hydra.run.dir={tmp_path}/resume"],
    }


def _refused_everywhere(ckpt: Path, tmp_path: Path, marker: Path, *extra: str) -> list[str]:
    """Run every entry point on ``ckpt``: each exits 2 with one ``error:`` line; the payload never runs."""
    lines = []
    for name, (script, *overrides) in _entry_points(ckpt, tmp_path).items():
        proc = run_entry(script, *overrides, *extra)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2 and len(errors) == 1, (name, proc.stderr[-2000:])
        assert not marker.exists(), f"{name} ran the checkpoint's payload"
        lines.append(errors[0])
    return lines


def test_a_pickle_that_runs_a_command_is_refused_by_every_entry_point(tmp_path):
    marker = tmp_path / "ran"
    torch.save({"state_dict": {}, "hyper_parameters": {"net": _Payload(marker)}}, tmp_path / "control.ckpt")
    torch.load(tmp_path / "control.ckpt", weights_only=False)
    assert marker.exists()  # the payload is real: an unguarded load runs it
    marker.unlink()

    for line in _refused_everywhere(tmp_path / "control.ckpt", tmp_path, marker):
        assert "holds Python objects other than tensors" in line and "fix: if you trust the file, pass " \
            "trust_checkpoint=true" in line


def test_a_forged_project_checkpoint_with_a_payload_is_refused(project_checkpoint, tmp_path):
    """Everything a checkpoint of this project carries (its callbacks' states, per-rank random and metric states,
    plain hyper-parameters) grants no trust: a payload beside them is refused."""
    marker = tmp_path / "ran"
    forged = torch.load(project_checkpoint, weights_only=True)
    assert {"random_state_per_rank", "callbacks", "hyper_parameters"} <= forged.keys()
    forged["hyper_parameters"]["written_by"] = _Payload(marker)
    torch.save(forged, tmp_path / "forged.ckpt")
    _refused_everywhere(tmp_path / "forged.ckpt", tmp_path, marker)


def test_a_stored_config_whose_target_is_os_system_is_refused(project_checkpoint, tmp_path):
    """Plain values load with weights_only=True; a stored ``_target_`` that this run's config does not name is
    refused before anything could build it."""
    marker = tmp_path / "ran"
    crafted = torch.load(project_checkpoint, weights_only=True)
    crafted["hyper_parameters"]["net"] = {"_target_": "os.system", "command": f"touch {marker}"}
    torch.save(crafted, tmp_path / "crafted.ckpt")
    for line in _refused_everywhere(tmp_path / "crafted.ckpt", tmp_path, marker):
        assert "names _target_='os.system' (at hyper_parameters.net)" in line and "trust_checkpoint=true" in line


def test_trust_checkpoint_loads_a_file_with_objects_and_nothing_in_it_is_built(project_checkpoint, tmp_path):
    foreign = torch.load(project_checkpoint, weights_only=True)
    foreign["hyper_parameters"]["optimizer"] = functools.partial(torch.optim.Adam, lr=1e-3)  # not plain
    torch.save(foreign, tmp_path / "foreign.ckpt")
    ckpt = tmp_path / "foreign.ckpt"
    refused = run_entry("eval", *TOY, f"ckpt_path={ckpt}", f"hydra.run.dir={tmp_path}/refused")
    assert refused.returncode == 2 and "trust_checkpoint=true" in refused.stderr
    trusted = run_entry("eval", *TOY, f"ckpt_path={ckpt}", "trust_checkpoint=true", f"hydra.run.dir={tmp_path}/eval")
    assert trusted.returncode == 0, trusted.stderr[-3000:]


def test_this_projects_checkpoint_loads_in_every_entry_point(project_checkpoint, tmp_path):
    torch.load(project_checkpoint, weights_only=True)
    for name, (script, *overrides) in _entry_points(project_checkpoint, tmp_path).items():
        proc = run_entry(script, *overrides)
        assert proc.returncode == 0, (name, proc.stderr[-2000:])
