"""Hydra launchers through submitit: a real local sweep here, and the SLURM job a sweep would submit.

There is no SLURM here. The SLURM test puts stand-ins for ``sbatch``/``srun`` on PATH: submitit writes
the real batch script and hands it to ``sbatch``, which saves it and refuses the job. The test then reads
the ``#SBATCH`` lines the cluster would have received.
"""

from __future__ import annotations

import csv
import os
import pickle
import re
from pathlib import Path

import pytest

from tests.helpers.config import ROOT
from tests.helpers.entry import run_entry

TINY = ["trainer.accelerator=cpu", "trainer.max_epochs=1", "++trainer.limit_train_batches=2",
        "++trainer.limit_val_batches=2", "++trainer.limit_test_batches=2", "extras.print_config=false"]


def last_logged(job_dir: Path, metric: str) -> float:
    with open(job_dir / "csv" / "version_0" / "metrics.csv") as f:
        return [float(row[metric]) for row in csv.DictReader(f) if row.get(metric)][-1]


@pytest.mark.slow
def test_submitit_local_sweep_returns_each_metric(tmp_path):
    """Two jobs through hydra/launcher=submitit_local: each comes back through submitit with its metric."""
    proc = run_entry("train", "-m", "hydra/launcher=submitit_local", "model.optimizer.lr=0.001,0.01", *TINY,
                     f"hydra.sweep.dir={tmp_path}/sweep", f"paths.log_dir={tmp_path}/logs", timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    results = [pickle.loads(p.read_bytes()) for p in (tmp_path / "sweep" / ".submitit").glob("*/*_result.pkl")]
    returned = {r.overrides[0]: r.return_value for status, r in results if status == "success"}
    assert sorted(returned) == ["model.optimizer.lr=0.001", "model.optimizer.lr=0.01"]
    for job, override in enumerate(["model.optimizer.lr=0.001", "model.optimizer.lr=0.01"]):
        assert returned[override] == pytest.approx(last_logged(tmp_path / "sweep" / str(job), "val/acc"), abs=1e-7)
    assert "[sweep] best of 2 jobs" in proc.stdout


def fake_slurm(bin_dir: Path) -> None:
    """``srun`` to be found, and an ``sbatch`` that keeps the batch script in $CAPTURE and refuses the job."""
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 1\n")
    (bin_dir / "sbatch").write_text('#!/bin/sh\nfor a; do last=$a; done\ncp "$last" "$CAPTURE"\n'
                                    'echo "no SLURM here: batch script kept" >&2\nexit 1\n')
    for tool in ("srun", "sbatch"):
        (bin_dir / tool).chmod(0o755)


@pytest.mark.fast
def test_slurm_launcher_config_takes_its_shape_from_the_trainer(make_cfg):
    cfg = make_cfg("train", ["hydra/launcher=slurm", "trainer=ddp", "trainer.devices=4", "trainer.num_nodes=2",
                             "hydra.launcher.partition=gpu", "hydra.launcher.account=proj"])
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node) == (2, 4, 4)
    assert (launcher.partition, launcher.account, launcher.timeout_min) == ("gpu", "proj", 120)


def test_slurm_sweep_submits_one_task_per_device(tmp_path):
    """`-m hydra/launcher=slurm trainer=ddp trainer.devices=4 trainer.num_nodes=2`: the batch script submitit writes."""
    fake_slurm(tmp_path / "bin")
    script = tmp_path / "job.sbatch"
    env = {"PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}", "CAPTURE": str(script)}
    proc = run_entry("train", "-m", "hydra/launcher=slurm", "trainer=ddp", "trainer.devices=4", "trainer.num_nodes=2",
                     "hydra.launcher.partition=gpu", "hydra.launcher.account=proj", f"hydra.sweep.dir={tmp_path}/sweep",
                     f"paths.log_dir={tmp_path}/logs", env=env, timeout=120)
    assert proc.returncode != 0 and "no SLURM here" in proc.stderr  # refused by the stand-in, after writing
    directives = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)$", script.read_text(), flags=re.M))
    assert directives["nodes"] == "2" and directives["ntasks-per-node"] == "4" and directives["gpus-per-node"] == "4"
    assert directives["partition"] == "gpu" and directives["account"] == "proj" and directives["time"] == "120"
    assert directives["signal"] == "USR2@90"  # submitit's time-out signal: it requeues the job (max_num_timeout)
    assert re.search(r"^srun .* -m submitit\.core\._submit ", script.read_text(), flags=re.M)  # srun starts the tasks


@pytest.mark.fast
def test_sbatch_script_agrees_with_the_launcher():
    """scripts/slurm/train_ddp.sbatch: one task per GPU, started by srun, shape passed to the trainer."""
    text = (ROOT / "scripts" / "slurm" / "train_ddp.sbatch").read_text()
    directives = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", text, flags=re.M))
    assert directives["ntasks-per-node"] == directives["gpus-per-node"]
    assert re.search(r"^srun .*src/train\.py trainer=ddp", text, flags=re.M)
    assert 'trainer.devices="${SLURM_NTASKS_PER_NODE}"' in text and 'trainer.num_nodes="${SLURM_NNODES}"' in text
    # before the time limit: every rank saves last.ckpt at an agreed batch and the job requeues itself
    assert directives["signal"] == "SIGUSR1@90" and re.search(r"^#SBATCH --requeue$", text, flags=re.M)
