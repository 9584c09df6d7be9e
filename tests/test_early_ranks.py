"""Ranks started with the command (src/engine/runtime/early_ranks.py): what they are told, when they start,
and that an unadopted one ends without a word. Real processes; no Lightning in the early ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from src.engine.runtime import early_ranks
from tests.helpers.config import ROOT
from tests.test_bad_input import TOY

SCRIPT = str(ROOT / "tests" / "helpers" / "early_rank_script.py")
PREFIX = [sys.executable, SCRIPT]


@pytest.fixture
def record(tmp_path, monkeypatch):
    monkeypatch.setenv("EARLY_TEST_ROOT", str(ROOT))
    monkeypatch.setenv("EARLY_TEST_RECORD", str(tmp_path / "record.json"))
    yield tmp_path / "record.json"
    early_ranks.end_unadopted()


@pytest.mark.fast
def test_an_adopted_rank_runs_the_launchers_command_in_its_directory_and_environment(record, tmp_path):
    early_ranks.start(1, PREFIX)
    env = {**os.environ, "LOCAL_RANK": "1", "MASTER_PORT": "12345"}  # set by the launcher after the start
    env.pop("HOME", None)  # and one the launch no longer has
    proc = early_ranks.adopt(1, [*PREFIX, "trainer=ddp", "a b"], env, str(tmp_path))
    assert proc is not None and proc.wait(timeout=60) == 0
    got = json.loads(record.read_text())
    assert got["argv"] == [SCRIPT, "trainer=ddp", "a b"]
    assert got["cwd"] == str(tmp_path)
    assert got["env"] == env  # exactly the launcher's environment: no gate variable, nothing of the start's


@pytest.mark.fast
def test_unadopted_ranks_end_without_output(record, capfd):
    early_ranks.start(2, PREFIX)
    procs = [early.proc for early in early_ranks._waiting.values()]
    assert early_ranks.adopt(3, [*PREFIX], dict(os.environ), None) is None  # no early process for rank 3
    early_ranks.end_unadopted()
    assert all(proc.returncode is not None for proc in procs)  # ended and reaped
    assert not record.exists()
    out, err = capfd.readouterr()
    assert out == err == ""


@pytest.mark.fast
def test_a_rank_started_for_another_script_is_not_adopted(record):
    early_ranks.start(1, PREFIX)
    (proc,) = [early.proc for early in early_ranks._waiting.values()]
    assert early_ranks.adopt(1, [sys.executable, "other.py"], dict(os.environ), None) is None
    assert proc.returncode is not None and not record.exists() and not early_ranks._waiting


@pytest.mark.fast
@pytest.mark.parametrize(
    ("overrides", "env", "count"),
    [
        (["trainer=ddp", "trainer.devices=4"], {}, 3),
        (["trainer=pipeline"], {}, 1),
        (["trainer=ps", "trainer.devices=5"], {}, 0),  # a restarted worker reads its rank from /proc/<pid>/environ
        ([], {}, 0),  # the default trainer: one device
        (["trainer=ddp_spawn"], {}, 0),  # torch starts those ranks
        (["trainer=dp"], {}, 0),  # one process
        (["trainer=ddp", "trainer.devices=auto"], {}, 0),  # not known before Lightning counts the devices
        (["-m", "trainer=ddp"], {}, 0),  # a sweep
        (["trainer=ddp", "hydra.mode=MULTIRUN"], {}, 0),
        (["trainer=ddp", "no_such_key=1"], {}, 0),  # a config error: the real compose reports it
        (["trainer=ddp"], {"LOCAL_RANK": "0", "RANK": "0", "TORCHELASTIC_RUN_ID": "x"}, 0),  # torchrun's
        (["trainer=ddp"], {"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, 0),  # srun's
        (["trainer=ddp"], {"LOCAL_RANK": "1"}, 0),  # a rank of this launch
    ],
)
def test_how_many_ranks_a_command_starts_early(overrides, env, count, monkeypatch):
    for name in ("LOCAL_RANK", "RANK", "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert early_ranks.ranks_to_start(overrides, str(ROOT / "configs"), "train.yaml", "1.3") == count


@pytest.mark.slow
def test_ddp_train_eval_and_predict_adopt_the_rank_they_started_with_the_command(tmp_path):
    """`python src/train.py trainer=ddp`, then `src/eval.py` and `src/predict.py` on its checkpoint: in each, rank 1
    started before rank 0 imported Lightning, and ran."""
    def run(script: str, *overrides: str) -> str:
        proc = subprocess.run([sys.executable, str(ROOT / "src" / f"{script}.py"), *TOY, "trainer=ddp",
                               "trainer.devices=2", f"hydra.run.dir={tmp_path}/{script}", *overrides],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return (tmp_path / script / f"{script}.log").read_text()

    ckpt = f"ckpt_path={tmp_path}/train/checkpoints/last.ckpt"
    for log in (run("train"), run("eval", ckpt), run("predict", ckpt)):
        assert "local ranks [1] had started with the command" in log
        assert "[rank 1]" in log  # it joined the run and logged into the parent's log file
