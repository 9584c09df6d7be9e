"""``trainer=fsdp`` from the command line, in every launch form of ``trainer=ddp``: ``python``, ``torchrun``,
``srun`` (simulated: the variables it sets) and a ``-m`` sweep; and bad input refused in one line before any
rank starts. Real processes, 2 CPU ranks over gloo on loopback."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest

from tests.helpers.config import ROOT
from tests.helpers.docs import assert_no_error_line, docs_command
from tests.helpers.entry import run_entry
from tests.helpers.processes import Processes, free_port
from tests.test_bad_input import error_line
from tests.test_ddp import TINY_RUN

FSDP = ["trainer=fsdp", "trainer.devices=2"]


@pytest.mark.parametrize(("overrides", "says"), [
    (["model.net._target_=torch.nn.Identity"], "no submodule with parameters to shard in ClassificationModule"),
    (["trainer.strategy.wrap=blocks", "model.net._target_=tests.test_fsdp.FCNet", "~model.net.in_channels",
      "~model.net.image_size", "~model.net.hidden_sizes", "~model.net.num_classes", "~model.net.dropout",
      "~model.net.batch_norm"], "wrap=blocks shards model.net by its named blocks, so it must be an nn.Sequential; "
                                "ClassificationModule.net is FCNet"),
    (["trainer.strategy.wrap=[torch.nn.Conv2d]"], "wrap names torch.nn.Conv2d, which no submodule of "
                                                    "ClassificationModule is"),
    (["trainer.strategy.sharding_strategy=hybrid", "trainer.strategy.hybrid_shard_size=3"],
     "cannot split 2 processes into hybrid shard groups of 3"),
    (["trainer.precision=16-mixed"], "trainer.precision=16-mixed is not supported by trainer=fsdp"),
    (["trainer.strategy.cpu_offload=true"], "this run is on the CPU already"),
    (["data.batch_size=127"], "data.batch_size=127 is the global batch and must divide evenly across 2"),
], ids=["no-parameters", "blocks-of-no-sequential", "class-not-in-model", "mesh-does-not-divide", "fp16", "offload-on-cpu", "global-batch"])
def test_bad_input_is_one_line_and_exit_2_before_any_rank_starts(tmp_path, overrides, says):
    proc = run_entry("train", *FSDP, *TINY_RUN, *overrides, f"hydra.run.dir={tmp_path}/run", timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = error_line(proc)
    assert says in line and ("; fix: " in line or "batch_size" in line), line  # the batch rule's line is older
    assert "Initializing distributed" not in proc.stdout + proc.stderr  # no rank was started


def test_any_lightning_module_shards(tmp_path):
    """Lightning's BoringModel and BoringDataModule (no `net` at all), as a user would run them: its one layer is a
    root unit of the ``size`` policy, trained on 2 ranks."""
    proc = run_entry("train", "~model", "+model._target_=lightning.pytorch.demos.boring_classes.BoringModel", "~data",
                     "+data._target_=lightning.pytorch.demos.boring_classes.BoringDataModule", *FSDP,
                     "callbacks=none", "optimized_metric=null", "trainer.max_epochs=1", "trainer.accelerator=cpu",
                     "extras.print_config=false", f"hydra.run.dir={tmp_path}/run", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_no_error_line(proc.stderr)
    assert "trainer=fsdp: wrap=size: 1 units, roots layer" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_torchrun_one_node(tmp_path):
    """The docs' `torchrun --standalone --nproc_per_node=2 src/train.py trainer=fsdp trainer.devices=2`, shortened:
    Lightning joins torchrun's ranks. It is this test that runs that docs command (tests/test_readme_commands.py)."""
    command = shlex.split(docs_command("torchrun --standalone --nproc_per_node=2 src/train.py trainer=fsdp "))
    proc = subprocess.run(  # the docs' arguments, then shorter ones (the last value wins)
        [sys.executable, "-m", "torch.distributed.run", *command[1:], *TINY_RUN, f"paths.log_dir={tmp_path}/logs"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_no_error_line(proc.stderr)
    (run,) = (tmp_path / "logs" / "train" / "runs").iterdir()
    assert "torchrun" in run.name  # both ranks chose the same directory
    assert sorted(p.name for p in (run / "checkpoints" / "last.ckpt").glob("*.distcp")) == ["__0_0.distcp",
                                                                                             "__1_0.distcp"]


@pytest.mark.slow
def test_slurm_environment_detected(tmp_path):
    """Two tasks with the variables `srun` sets: Lightning's SLURMEnvironment joins them; one shared run dir."""
    job_id = str(910000 + os.getpid() % 1000)
    common = {"SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NODEID": "0", "SLURM_JOB_ID": job_id,
              "SLURM_JOB_NAME": "train", "SLURM_NODELIST": "127.0.0.1", "MASTER_PORT": str(free_port())}
    envs = [{**common, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)} for r in (0, 1)]
    with Processes() as procs:
        for r, env in enumerate(envs):
            procs.start(f"task {r}", [sys.executable, str(ROOT / "src/train.py"), *FSDP, *TINY_RUN,
                                      f"paths.log_dir={tmp_path}/logs"],
                        log=tmp_path / f"task{r}.log", cwd=ROOT, env={**os.environ, **env})
        codes = procs.wait(300, "both srun tasks to train and exit")
        assert list(codes.values()) == [0, 0], procs.report()
    (run,) = (tmp_path / "logs" / "train" / "runs").iterdir()
    assert f"slurm_{job_id}" in run.name  # both tasks agreed on one directory
    assert len(list((run / "checkpoints" / "last.ckpt").glob("*.distcp"))) == 2  # a shard from each task


@pytest.mark.slow
def test_multirun_sweep(tmp_path):
    """`-m trainer=fsdp trainer.devices=2 lr=a,b`: both jobs run, each job's ranks stay in its own dir."""
    proc = run_entry(
        "train", "-m", *FSDP, "trainer.accelerator=cpu", "model.optimizer.lr=0.01,0.1", "trainer.max_epochs=1",
        "++trainer.limit_train_batches=4", "++trainer.limit_val_batches=2", "++trainer.limit_test_batches=2",
        "extras.print_config=false", f"hydra.sweep.dir={tmp_path}/sweep", f"paths.log_dir={tmp_path}/logs",
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = sorted(p.name for p in (tmp_path / "sweep").iterdir() if p.is_dir())
    assert jobs == ["0", "1"]
    for job in jobs:
        assert (tmp_path / "sweep" / job / "checkpoints" / "last.ckpt" / "meta.pt").is_file()
        overrides = (tmp_path / "sweep" / job / ".hydra" / "overrides.yaml").read_text()
        assert f"model.optimizer.lr={['0.01', '0.1'][int(job)]}" in overrides
    assert not (tmp_path / "logs").exists() or {p.name for p in (tmp_path / "logs").iterdir()} <= {".pids"}
    assert (proc.stdout + proc.stderr).count("Initializing distributed: GLOBAL_RANK: 1") == 2  # one child per job
