"""DDP proven with real processes over gloo: identical replicas, disjoint shards, exact synced metrics,
ddp_spawn, a simulated two-node run, rank-safe side effects and a multirun sweep."""

from __future__ import annotations

import csv
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback

from tests.helpers.config import ROOT, compose_cfg
from tests.helpers.docs import assert_no_error_line, docs_command
from tests.helpers.entry import run_entry
from tests.helpers.multiprocess import run_workers
from tests.helpers.processes import Processes, free_port
from tests.helpers.run_if import requires_2_gpus

# Full val/test sets (exactness is about every sample), 8 training steps, no dropout so runs are comparable.
EXACT = ["model.net.dropout=0", "data.batch_size=64", "data.val_size=4999", "++trainer.limit_train_batches=8",
         "++trainer.limit_val_batches=1.0", "++trainer.limit_test_batches=1.0"]


def ddp_fit(rank: int, world_size: int, out_dir: str, data_dir: str, trainer_group: str = "ddp") -> dict:
    """One rank of ``train(cfg)`` with ``trainer=ddp`` (or another group); returns what the test compares."""
    from lightning.pytorch.trainer.states import RunningStage

    from src.data.mnist_datamodule import MNISTDataModule
    from src.engine.data.in_memory import InMemoryDataset
    from src.train import train

    extracted = Path(out_dir) / "extracted_by.txt"
    original = MNISTDataModule._extract_from

    def counting_extract(self, source):  # record which rank prepared the data
        with open(extracted, "a") as f:
            f.write(f"{rank}\n")
        return original(self, source)

    MNISTDataModule._extract_from = counting_extract
    fetched: list[int] = []
    original_getitems = InMemoryDataset.__getitems__

    def recording_getitems(self, indices):  # the indices this rank's training loader actually fetched
        if self.inputs.shape[0] > 20000:
            fetched.extend(int(i) for i in indices)
        return original_getitems(self, indices)

    InMemoryDataset.__getitems__ = recording_getitems
    cfg = compose_cfg("train", [f"trainer={trainer_group}", f"trainer.devices={world_size}", "trainer.accelerator=cpu", *EXACT],
                      Path(out_dir))
    cfg.paths.data_dir = data_dir
    cfg.data.data_dir = data_dir
    metrics, objects = train(cfg)
    trainer, dm, model = objects["trainer"], objects["datamodule"], objects["model"]
    # The loader Lightning built for fit, rebuilt the same way.
    loader = trainer._data_connector._prepare_dataloader(dm.train_dataloader(), shuffle=True,
                                                          mode=RunningStage.TRAINING)
    loader.sampler.set_epoch(0)
    return {
        "fetched": fetched,
        "params": {k: v.detach().clone() for k, v in model.net.state_dict().items()},
        "metrics": {k: float(v) for k, v in metrics.items()},
        "train_indices": list(iter(loader.sampler)),
        "val_indices": list(iter(dm.val_dataloader().sampler)),
        "test_indices": list(iter(dm.test_dataloader().sampler)),
        "global_rank": trainer.global_rank,
        "ckpt": trainer.checkpoint_callback.best_model_path,
    }


def full_set_metrics(params: dict, dataset, dm, indices=None) -> tuple[float, float]:
    """Single-process loss and accuracy of ``params`` over ``dataset`` (or a subset), sample-weighted."""
    from src.models.components.mlp import MLP

    net = MLP(dropout=0)
    net.load_state_dict(params)
    net.eval()
    idx = torch.arange(len(dataset)) if indices is None else torch.as_tensor(indices)
    with torch.no_grad():
        x = dm.transform_batch(dataset.inputs[idx], training=False)
        logits = net(x)
        target = dataset.targets[idx]
        loss = F.cross_entropy(logits.double(), target, reduction="sum").item() / len(idx)
        acc = (logits.argmax(1) == target).double().mean().item()
    return loss, acc


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    """A 2-rank DDP fit (fresh data dir, so data preparation is observed) and the same run in one process
    (``trainer=default``, no process group)."""
    fresh = tmp_path_factory.mktemp("fresh_data")
    two = run_workers(ddp_fit, 2, str(tmp_path_factory.mktemp("ddp2")), str(fresh))
    one = run_workers(ddp_fit, 1, str(tmp_path_factory.mktemp("single")), str(ROOT / "data"), "default")
    return two, one[0], fresh


@pytest.mark.slow
def test_replicas_identical_and_equal_to_single_process(ddp_runs):
    (r0, r1), single, _ = ddp_runs
    for name, value in r0["params"].items():
        assert torch.equal(value, r1["params"][name]), f"{name} differs between ranks"
        torch.testing.assert_close(value, single["params"][name], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_train_shards_are_slices_of_the_single_process_global_batches(ddp_runs):
    (r0, r1), single, _ = ddp_runs
    n, batch = 55001, 64  # 60000 - val_size 4999; the last incomplete global batch is dropped, nothing is padded
    assert len(r0["train_indices"]) == len(r1["train_indices"]) == (n // batch) * batch // 2
    assert not set(r0["train_indices"]) & set(r1["train_indices"])
    halves = [torch.tensor(r["train_indices"]).view(-1, batch // 2) for r in (r0, r1)]
    assert torch.equal(torch.cat(halves, dim=1).flatten(), torch.tensor(single["train_indices"]))
    for r in (r0, r1):  # what each rank actually trained on is the head of its shard
        assert r["fetched"] == r["train_indices"][: len(r["fetched"])] and len(r["fetched"]) == 8 * 32


@pytest.mark.slow
def test_eval_shards_unpadded(ddp_runs):
    (r0, r1), _, _ = ddp_runs
    for key, n in (("val_indices", 4999), ("test_indices", 10000)):
        a, b = r0[key], r1[key]
        assert not set(a) & set(b) and sorted(a + b) == list(range(n))
    assert len(r0["val_indices"]) != len(r1["val_indices"])  # uneven shards, no duplicated samples


@pytest.mark.slow
def test_synced_val_and_test_metrics_are_exact(ddp_runs):
    from src.data.mnist_datamodule import FashionMNISTDataModule

    (r0, r1), _, _ = ddp_runs
    dm = FashionMNISTDataModule(data_dir=str(ROOT / "data"), val_size=4999, batch_size=64)
    dm.prepare_data()
    dm.setup()
    for split, dataset in (("val", dm.data_val), ("test", dm.data_test)):
        loss, acc = full_set_metrics(r0["params"], dataset, dm)
        local = [full_set_metrics(r["params"], dataset, dm, r[f"{split}_indices"]) for r in (r0, r1)]
        assert local[0] != local[1]  # each rank alone sees different values...
        for r in (r0, r1):  # ...yet every rank logged the whole-set value
            assert r["metrics"][f"{split}/loss"] == pytest.approx(loss, abs=1e-6)
            assert r["metrics"][f"{split}/acc"] == pytest.approx(acc, abs=1e-6)


@pytest.mark.slow
def test_side_effects_happen_on_rank_zero_only(ddp_runs):
    (r0, r1), _, fresh = ddp_runs
    out = Path(r0["ckpt"]).parents[1]
    assert (out / "extracted_by.txt").read_text().split() == ["0"]  # prepared once, by rank 0
    assert (fresh / "FashionMNIST" / "raw" / "train-images-idx3-ubyte").is_file()
    assert r0["ckpt"] == r1["ckpt"] and Path(r0["ckpt"]).is_file()  # one checkpoint, written by rank 0
    assert (out / "metrics.png").is_file()


@pytest.mark.slow
def test_ddp_spawn_returns_metrics_to_parent(make_cfg):
    from src.train import train

    cfg = make_cfg("train", ["trainer=ddp_spawn", "trainer.devices=2", "trainer.accelerator=cpu",
                             "++trainer.limit_train_batches=4"])
    metrics, objects = train(cfg)
    assert 0.0 < float(metrics["test/acc"]) <= 1.0 and "val/acc" in metrics
    assert Path(objects["trainer"].checkpoint_callback.best_model_path).is_file()
    # fit and test are separate launches; both continue the run's one CSV log (src/engine/loggers/resumable.py)
    (version,) = (Path(cfg.paths.output_dir) / "csv").iterdir()
    with open(version / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert any(row["val/acc"] for row in rows) and rows[-1]["test/acc"]
    # the parent's own trainer ran no loop: where the run ended is the ranks' (it was "epoch 0, global step 0")
    epochs = cfg.trainer.max_epochs
    assert f'detail: "epoch {epochs}, global step {4 * epochs}"' in (Path(cfg.paths.output_dir) / "status.yaml").read_text()


class CountsFirstBatch(Callback):
    """Writes, per rank, the training loss metric's sample count and the batch size after the first batch."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == 0:
            (Path(self.out) / f"rank{trainer.global_rank}").write_text(f"{int(pl_module.train_loss.count)} {len(batch[1])}")


@pytest.mark.slow
def test_spawned_ranks_keep_their_own_running_metrics(make_cfg, tmp_path):
    """Spawn passes the model through shared memory: each rank's torchmetrics states must be its own, or every
    rank adds into one sum and a mid-epoch checkpoint saves the total as each rank's state."""
    from src.train import train

    train(make_cfg("train", ["trainer=ddp_spawn", "trainer.devices=2", "trainer.accelerator=cpu", "test=false",
                             "trainer.max_epochs=1", "++trainer.limit_train_batches=2",
                             "+callbacks.counts._target_=tests.test_ddp.CountsFirstBatch",
                             f"+callbacks.counts.out={tmp_path}"]))
    assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == ["64 64", "64 64"]


TINY_RUN = ["trainer.accelerator=cpu", "trainer.max_epochs=1", "++trainer.limit_train_batches=6",
            "++trainer.limit_val_batches=2", "++trainer.limit_test_batches=2", "extras.print_config=false"]


@pytest.mark.slow
@pytest.mark.faults
def test_ddp_spawn_names_the_rank_that_failed_not_its_healthy_peer(tmp_path):
    """Rank 1 fails, its connections close at once and its exit takes 3 s more (as a logger's finish can).
    Rank 0 loses its peer first, yet the error the user sees is rank 1's, and rank 0 only says it stopped."""
    proc = run_entry("train", "trainer=ddp_spawn", "trainer.devices=2", *TINY_RUN, "test=false",
                     "+callbacks.fail._target_=tests.helpers.failing_rank.FailingRank", f"paths.log_dir={tmp_path}")
    assert proc.returncode != 0
    assert "Process 1 terminated with the following error" in proc.stderr, proc.stderr[-3000:]
    assert "RuntimeError: the failure of rank 1" in proc.stderr
    assert "rank 0: stopping because another rank failed" in proc.stderr
    assert "Connection closed by peer" not in proc.stderr  # the healthy rank's gloo error is not the report
    (log,) = (tmp_path / "train" / "runs").glob("*/train.log")  # spawned ranks log where the parent does
    assert re.search(r"\[rank 0\].* - data replica 0/2", log.read_text()), log.read_text()[-3000:]
    assert re.search(r"\[rank 1\].* - data replica 1/2", log.read_text())


@pytest.mark.slow
@pytest.mark.faults
def test_ddp_fork_stops_at_the_end_of_fit_on_a_late_sigterm_then_the_same_command_tests(tmp_path):
    """``trainer=ddp_fork`` (the fast CPU start), checking every 100 batches of a 6-batch fit: the SIGTERM each rank
    gets at batch 3 comes after the only check (batch 0). The ranks agree once more at the end of fit, so the job
    stops there, exit 143 with the final ``last.ckpt``, and does not test (before, the note was forgotten: it
    tested and exited 0). The same command then tests, and ``status.yaml`` has where the ranks' fit ended."""
    command = ["train", "trainer=ddp_fork", "trainer.devices=2", *TINY_RUN, f"paths.log_dir={tmp_path}",
               "trainer.strategy.sigterm_check_every_n_batches=100",
               "+callbacks.sigterm._target_=tests.test_last_checkpoint.SigtermDuring", "+callbacks.sigterm.batch=3"]
    stopped = run_entry(*command)
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    (run_dir,) = (tmp_path / "train" / "runs").iterdir()
    log = (run_dir / "train.log").read_text()
    assert sorted(re.findall(r"\[rank (\d)\].*SIGTERM: every rank stopped at epoch 1, global step 6", log)) == ["0", "1"]
    assert "status: preempted" in (run_dir / "status.yaml").read_text()
    assert "test/acc" not in (run_dir / "csv" / "version_0" / "metrics.csv").read_text()

    again = run_entry(*command)
    assert again.returncode == 0, again.stderr[-3000:]
    assert list((tmp_path / "train" / "runs").iterdir()) == [run_dir]  # the same run, resumed from its final save
    status = (run_dir / "status.yaml").read_text()
    assert 'status: finished\ndetail: "epoch 1, global step 6"' in status and "test/acc" in status, status


@pytest.mark.slow
@pytest.mark.faults
def test_status_names_the_failed_ranks_error_not_rank_zeros_lost_connection(tmp_path):
    """Under ``trainer=ddp`` rank 1 raises; rank 0, which writes ``status.yaml``, only sees gloo's closed connection.
    The file ends with rank 1's own error (before: rank 0's ``Connection closed by peer``)."""
    proc = run_entry("train", "trainer=ddp", "trainer.devices=2", *TINY_RUN, "test=false", f"paths.log_dir={tmp_path}",
                     "+callbacks.fail._target_=tests.helpers.failing_rank.FailingRank", "+callbacks.fail.exit_s=0")
    assert proc.returncode != 0 and "RuntimeError: the failure of rank 1" in proc.stderr, proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "train" / "runs").iterdir()
    deadline = time.monotonic() + 30  # rank 1 may still be ending when the launched process has exited
    while "rank 1: RuntimeError" not in (status := (run_dir / "status.yaml").read_text()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert 'detail: "rank 1: RuntimeError at epoch 0, global step 2: the failure of rank 1"' in status, status


@pytest.mark.fast
@pytest.mark.parametrize("written", ["in-this-attempt", "before-this-process-started"])
def test_rank_zeros_start_keeps_a_failure_another_rank_recorded_first(tmp_path, written):
    """Under torchrun or srun every rank starts at once, and rank 1 may fail (and record why) before rank 0 enters
    its task: rank 0 then keeps that record instead of writing ``running`` over it, and keeps it when it loses its
    connection to rank 1. A record of an earlier attempt (older than this process) is replaced as before."""
    import datetime as dt

    import lightning as L

    from src.engine.run.status import FAILED, RUNNING, read_fields, run_status, write_status

    write_status(tmp_path, FAILED, "rank 1: DataError at epoch 0, global step 0: bad file", rank=1)
    if written == "before-this-process-started":
        status = tmp_path / "status.yaml"
        status.write_text(re.sub(r"time: '[^']*'", f"time: '{dt.datetime(2001, 1, 1).isoformat()}'", status.read_text()))
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ConnectionError), run_status(trainer, tmp_path):
        started_as = read_fields(tmp_path)["status"]
        raise ConnectionError("Connection closed by peer")  # what rank 0 sees when rank 1 is gone
    fields = read_fields(tmp_path)
    if written == "in-this-attempt":
        assert started_as == FAILED and fields["detail"].startswith("rank 1: DataError"), fields
    else:
        assert started_as == RUNNING and fields["detail"].startswith("another rank failed"), fields


def launch_ranks(envs: list[dict], per_rank_args, params_dir: Path) -> list[dict]:
    """Start one ``python src/train.py`` per env (as separate nodes or srun tasks would), wait, load each rank's params."""
    with Processes() as procs:  # output to files (a pipe read after another process ends could fill and block)
        for i, env in enumerate(envs):
            args = [sys.executable, str(ROOT / "src/train.py"), *per_rank_args(i),
                    "+callbacks.rank_params._target_=tests.helpers.rank_dump.SaveRankParams",
                    f"+callbacks.rank_params.dirpath={params_dir}"]
            procs.start(f"launch {i}", args, log=params_dir.parent / f"launch{i}.log", cwd=ROOT,
                        env={**os.environ, **env})
        codes = procs.wait(300, f"all {len(envs)} launches to train and exit")
        assert list(codes.values()) == [0] * len(envs), procs.report()
    return [torch.load(params_dir / f"params_rank{r}.pt") for r in range(len(envs))]


def assert_same_params(states: list[dict]) -> None:
    first = states[0]
    for other in states[1:]:
        assert first.keys() == other.keys() and all(torch.equal(first[k], other[k]) for k in first)


@pytest.mark.slow
def test_simulated_two_nodes_over_loopback(tmp_path):
    """Two launches, NODE_RANK 0 and 1, one CPU process each, rendezvous on 127.0.0.1."""
    port = str(free_port())
    envs = [{"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "NODE_RANK": str(node)} for node in (0, 1)]
    states = launch_ranks(
        envs, lambda node: ["trainer=ddp", "trainer.devices=1", "trainer.num_nodes=2", *TINY_RUN,
                            f"hydra.run.dir={tmp_path}/node{node}"], tmp_path / "params")
    assert_same_params(states)
    assert (tmp_path / "node0" / "checkpoints").is_dir()
    assert not (tmp_path / "node1" / "checkpoints").exists()  # only global rank 0 saves
    assert not (tmp_path / "node1" / "metrics.png").exists()


@pytest.mark.slow
def test_slurm_environment_detected(tmp_path):
    """Two tasks with the variables `srun` sets: Lightning's SLURMEnvironment joins them; one shared run dir."""
    job_id = str(900000 + os.getpid() % 1000)
    common = {"SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NODEID": "0", "SLURM_JOB_ID": job_id,
              "SLURM_JOB_NAME": "train", "SLURM_NODELIST": "127.0.0.1", "MASTER_PORT": str(free_port())}
    envs = [{**common, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)} for r in (0, 1)]
    states = launch_ranks(envs, lambda r: ["trainer=ddp", "trainer.devices=2", *TINY_RUN,
                                           f"paths.log_dir={tmp_path}/logs"], tmp_path / "params")
    assert_same_params(states)
    runs = list((tmp_path / "logs" / "train" / "runs").iterdir())
    assert len(runs) == 1 and f"slurm_{job_id}" in runs[0].name  # both tasks agreed on one directory
    assert (runs[0] / "checkpoints" / "last.ckpt").is_file()
    log = (runs[0] / "train.log").read_text()
    assert "[rank 0]" in log and "[rank 1]" in log  # one log, each line tagged with its rank


@pytest.mark.slow
def test_multirun_sweep_with_ddp(tmp_path):
    """The docs' `-m trainer=ddp trainer.devices=2 lr=a,b`, shortened: every job runs, each job's ranks stay in its
    own dir. It is this test that runs that docs command (tests/test_readme_commands.py)."""
    command = shlex.split(docs_command("python src/train.py -m trainer=ddp "))
    lrs = dict(arg.split("=", 1) for arg in command[3:])["model.optimizer.lr"].split(",")
    proc = run_entry(  # the docs' arguments, then shorter ones
        "train", *command[2:], "trainer.accelerator=cpu", "trainer.max_epochs=1", "++trainer.limit_train_batches=4",
        "++trainer.limit_val_batches=2", "++trainer.limit_test_batches=2", "extras.print_config=false",
        f"hydra.sweep.dir={tmp_path}/sweep", f"paths.log_dir={tmp_path}/logs", timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_no_error_line(proc.stderr)
    jobs = sorted(p.name for p in (tmp_path / "sweep").iterdir() if p.is_dir())
    assert len(lrs) >= 2 and jobs == [str(job) for job in range(len(lrs))]
    for job in jobs:
        assert (tmp_path / "sweep" / job / "checkpoints" / "last.ckpt").is_file()
        overrides = (tmp_path / "sweep" / job / ".hydra" / "overrides.yaml").read_text()
        assert f"model.optimizer.lr={lrs[int(job)]}" in overrides
    # no rank replayed the sweep into its own run dirs (only the ranks' PID registry lives there)
    assert not (tmp_path / "logs").exists() or {p.name for p in (tmp_path / "logs").iterdir()} <= {".pids"}
    assert proc.stdout.count("Initializing distributed: GLOBAL_RANK: 1") + proc.stderr.count(
        "Initializing distributed: GLOBAL_RANK: 1") == len(jobs)  # exactly one rank-1 child per job



@requires_2_gpus
@pytest.mark.gpu
def test_sync_batchnorm_on_gpus(make_cfg):
    """On 2 GPUs with nccl, sync_batchnorm turns every BatchNorm of ResNet18 into SyncBatchNorm."""
    from src.train import train

    cfg = make_cfg("train", ["trainer=ddp_spawn", "trainer.devices=2", "trainer.accelerator=gpu",
                             "trainer.sync_batchnorm=true", "model=resnet18", "data.batch_size=32",
                             "++trainer.limit_train_batches=2"])
    metrics, objects = train(cfg)
    assert torch.isfinite(metrics["test/loss"])


@pytest.mark.slow
def test_torchrun_one_node(tmp_path):
    """The docs' `torchrun --standalone --nproc_per_node=2 src/train.py trainer=ddp`, shortened: Lightning joins
    torchrun's ranks. It is this test that runs that docs command (tests/test_readme_commands.py)."""
    command = shlex.split(docs_command("torchrun --standalone --nproc_per_node=2 src/train.py trainer=ddp "))
    proc = subprocess.run(  # the docs' arguments, then shorter ones (the last value wins)
        [sys.executable, "-m", "torch.distributed.run", *command[1:], *TINY_RUN, f"paths.log_dir={tmp_path}/logs"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_no_error_line(proc.stderr)
    runs = list((tmp_path / "logs" / "train" / "runs").iterdir())
    assert len(runs) == 1 and "torchrun" in runs[0].name  # both ranks chose the same directory
    assert (runs[0] / "checkpoints" / "last.ckpt").is_file()
    assert "[rank 1]" in (runs[0] / "train.log").read_text()


@pytest.mark.fast
def test_a_child_rank_runs_the_parents_job_settings(tmp_path):
    """A child rank's command keeps the job's Hydra settings (chdir, env_set) and the task's overrides, and takes
    the parent's run dir, job name and RUN mode in place of the parent's own."""
    from src.engine.strategies.launchers import child_command

    compose_cfg("train", ["trainer=ddp", "hydra.job.chdir=true", "+hydra.job.env_set.FOO=1", "hydra.run.dir=elsewhere",
                          "hydra.job.name=mine"], tmp_path)
    command, cwd = child_command(1)
    assert {"hydra.job.chdir=true", "+hydra.job.env_set.FOO=1", "trainer=ddp"} <= set(command)
    assert "hydra.run.dir=elsewhere" not in command and command.count("hydra.job.name=mine") == 1
    assert command[-4:] == [f'hydra.run.dir="{tmp_path}"', "hydra.job.name=mine", "hydra.output_subdir=null",
                            "hydra.mode=RUN"]
    assert cwd == str(ROOT)
