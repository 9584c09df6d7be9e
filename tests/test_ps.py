"""``trainer=ps`` with real processes over gloo on loopback: synchronous mode equals synchronous SGD and DDP, a
slow worker does not set the pace, async reaches DDP's test accuracy, every launch form runs, and bad input fails
in one line before any rank starts.

Faults (a worker killed, a server killed, a worker started again) are in ``tests/test_ps_faults.py``.
"""

from __future__ import annotations

import csv
import datetime as dt
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.fabric.plugins.environments.lightning import find_free_network_port

from src.engine.callbacks.slow_rank import read_rates
from src.engine.strategies.ps.layout import shard_by_size
from src.engine.utils.errors import ConfigError
from tests.helpers.config import ROOT
from tests.helpers.entry import run_entry
from tests.helpers.multiprocess import run_workers
from tests.helpers.processes import Processes, free_port

# Toy regression (plain SGD): fast to start, fast to train; dropout-free, so runs compare bit for bit.
TOY = ["experiment=toy", "trainer.accelerator=cpu", "extras.print_config=false", "callbacks.metric_plot=null",
       "logger=csv", "trainer.max_epochs=1"]
SLOW = ["+callbacks.slow._target_=src.engine.callbacks.slow_rank.SlowRank"]


def train_run(run_dir: Path, *overrides: str, timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = run_entry("train", *overrides, f"hydra.run.dir={run_dir}", timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def last_state(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


# -- layout ---------------------------------------------------------------------------------------------------
@pytest.mark.fast
def test_shards_are_whole_tensors_balanced_by_size():
    sizes = [100, 10, 60, 50, 5]
    owner = shard_by_size(sizes, 2)
    load = [sum(s for s, o in zip(sizes, owner, strict=True) if o == server) for server in (0, 1)]
    assert owner == [0, 0, 1, 1, 0] and load == [115, 110]
    assert shard_by_size(sizes, 1) == [0] * 5
    assert sorted(shard_by_size([7] * 4, 4)) == [0, 1, 2, 3]  # one tensor each


# -- bad input: one line, exit 2 -------------------------------------------------------------------------------
@pytest.mark.fast
@pytest.mark.parametrize(("kwargs", "message"), [
    ({"num_servers": 0}, "num_servers=0 is not an integer >= 1"),
    ({"max_staleness": -1}, "max_staleness=-1 must be an integer >= 0"),
    ({"server_device": "gpu"}, "server_device='gpu' is unknown; fix: use one of auto, cpu"),
    ({"start_method": "spawn"}, "popen only"),
    ({"stages": 2}, "trainer.strategy.stages is a trainer=pipeline setting, but this run uses trainer=ps"),
    ({"hang_timeout_s": 10}, "trainer=ps has none: a silent link is timed by trainer.strategy.link_timeout_s"),
    ({"link_timeout_s": 0}, "link_timeout_s=0 is not a positive number of seconds"),
])
def test_the_constructor_refuses_bad_settings(kwargs, message):
    from src.engine.strategies.ps.strategy import ParameterServerStrategy

    with pytest.raises(ConfigError, match=re.escape(message)):
        ParameterServerStrategy(**kwargs)


@pytest.mark.fast
@pytest.mark.parametrize(("max_staleness", "live_lr"), [(None, 0.005), (0, 0.01)], ids=["async", "sync"])
def test_a_servers_checkpoint_keeps_the_scheduled_learning_rate(max_staleness, live_lr):
    """Asynchronous, a push is 1/W of the global batch and the live step takes lr/W; the checkpoint keeps the
    schedule's lr, or every resume would divide it by W again."""
    from src.engine.strategies.ps.server import ParameterServer

    net = torch.nn.Linear(2, 1)
    server = ParameterServer(list(net.parameters()), torch.optim.Adam(net.parameters(), lr=0.01), [], 2,
                             max_staleness, torch.device("cpu"))
    server._step()
    assert server.optimizer.param_groups[0]["lr"] == live_lr
    assert server.optimizer_state()["param_groups"][0]["lr"] == 0.01


@pytest.mark.fast
def test_sync_batchnorm_reaches_ps_and_is_refused():
    """ps is not Lightning's DDP, yet the Trainer still hands it the SyncBatchNorm plugin, which it refuses."""
    import lightning as L

    from src.engine.strategies.ps.strategy import ParameterServerStrategy

    strategy = ParameterServerStrategy()
    trainer = L.Trainer(accelerator="cpu", devices=3, strategy=strategy, sync_batchnorm=True, logger=False)
    with pytest.raises(ConfigError, match="sync_batchnorm=true needs a process group over the workers"):
        strategy.check_before_launch(trainer, L.LightningModule())
    assert (strategy.num_nodes, strategy.num_processes, strategy.world_size) == (1, 3, 3)


@pytest.mark.fast
def test_pipeline_dp_ddp_and_fsdp_refuse_ps_settings():
    from src.engine.strategies import DataParallelStrategy, DDPStrategy, FSDPStrategy, PipelineStrategy

    for strategy, name in ((PipelineStrategy, "pipeline"), (DataParallelStrategy, "dp"), (DDPStrategy, "ddp"),
                           (FSDPStrategy, "fsdp")):
        with pytest.raises(ConfigError, match=f"is a trainer=ps setting, but this run uses trainer={name}"):
            strategy(num_servers=1)


@pytest.mark.parametrize(("overrides", "message"), [
    (["trainer=ps", "trainer.devices=2", "trainer.strategy.num_servers=2"],
     "num_servers=2 leaves no worker among the 2 processes"),
    (["trainer=ps", "trainer.strategy.max_staleness=-1"], "max_staleness=-1 must be an integer >= 0"),
    (["trainer=ps", "+trainer.strategy.dp_size=2"], "dp_size is a trainer=pipeline setting"),
    (["trainer=pipeline", "+trainer.strategy.num_servers=1"], "num_servers is a trainer=ps setting"),
    (["trainer=dp", "+trainer.strategy.max_staleness=0"], "max_staleness is a trainer=ps setting"),
], ids=["no-worker-left", "negative-staleness", "ps-with-pipeline", "pipeline-with-ps", "dp-with-ps"])
def test_bad_input_is_one_line_and_exit_2_before_any_rank_starts(tmp_path, overrides, message):
    proc = run_entry("train", *overrides, "trainer.accelerator=cpu", f"hydra.run.dir={tmp_path}/run")
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and message in lines[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


# -- synchronous mode is synchronous SGD -----------------------------------------------------------------------
def ps_sync_sgd(rank: int, world_size: int, port: int, steps: int, batch_size: int, lr: float, seed: int):
    """Rank 0 serves, the others push: the collectives room's toy problem, shards and batches, max_staleness=0."""
    from src.engine.collectives.sync_sgd import partition_dataset, shard_batch, toy_problem
    from src.engine.strategies.ps.client import ServerClient
    from src.engine.strategies.ps.coordination import JobStore
    from src.engine.strategies.ps.serve import ServerLinks
    from src.engine.strategies.ps.server import ParameterServer

    timeout = dt.timedelta(seconds=60)
    jobs = JobStore(torch.distributed.TCPStore("127.0.0.1", port, world_size, rank == 0, timeout=timeout), timeout)
    data, model = toy_problem(seed)
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=lr)
    workers = world_size - 1
    if rank == 0:
        server = ParameterServer(params, optimizer, [], workers, 0, torch.device("cpu"))
        links = ServerLinks(server, jobs, 0, timeout, timeout)
        links.start()
        server.open(0, steps)
        assert server.wait_applied(steps, 120)
        jobs.store.wait([jobs.key("left", w) for w in range(workers)])
        links.stop()
        server.write_back()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    shard = partition_dataset(data, rank - 1, workers, seed=seed)
    client = ServerClient(jobs, rank - 1, [params], [], timeout, timeout)
    client.join()
    for step in range(steps):
        x, y = shard_batch(shard, step, batch_size)
        model.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        client.push_pull(float(loss) * len(x), len(x))
    client.leave()
    jobs.store.set(jobs.key("left", rank - 1), "1")
    return None


def sync_sgd(rank: int, world_size: int, steps: int, batch_size: int, lr: float, seed: int):
    from src.engine.collectives.sync_sgd import sync_sgd_weights

    return sync_sgd_weights(steps, batch_size, lr, seed)


@pytest.mark.slow
def test_synchronous_ps_equals_the_collectives_rooms_sync_sgd():
    """One server, two workers, max_staleness=0: the weights after 12 steps equal hand-written synchronous SGD
    (all_reduce of the same shards' gradients) within 1e-6."""
    args = (12, 16, 0.05, 0)
    ps = run_workers(ps_sync_sgd, 3, find_free_network_port(), *args)[0]
    reference = run_workers(sync_sgd, 2, *args)
    assert max_diff(reference[0], reference[1]) == 0
    assert max_diff(ps, reference[0]) < 1e-6


@pytest.mark.slow
def test_synchronous_ps_equals_ddp_through_train_py(tmp_path):
    """The Fashion-MNIST MLP with Adam, 8 steps of a 64-sample global batch, no dropout: 1 server + 2 workers at
    max_staleness=0 end with DDP's weights (2 ranks) within 1e-6, and the optimizer state too."""
    common = ["trainer.accelerator=cpu", "trainer.max_epochs=1", "++trainer.limit_train_batches=8",
              "++trainer.limit_val_batches=2", "test=false", "model.net.dropout=0", "data.batch_size=64",
              "extras.print_config=false", "callbacks.metric_plot=null"]
    train_run(tmp_path / "ps", "trainer=ps", "trainer.devices=3", "trainer.strategy.max_staleness=0", *common)
    train_run(tmp_path / "ddp", "trainer=ddp", "trainer.devices=2", *common)
    ps, ddp = (torch.load(tmp_path / r / "checkpoints" / "last.ckpt", weights_only=True) for r in ("ps", "ddp"))
    assert ps["global_step"] == ddp["global_step"] == 8
    assert max_diff(ps["state_dict"], ddp["state_dict"]) < 1e-6
    states = [c["optimizer_states"][0]["state"] for c in (ps, ddp)]
    assert states[0].keys() == states[1].keys()  # every server's share merged into one whole-model state dict
    assert max(max_diff(states[0][i], states[1][i]) for i in states[1]) < 1e-6


# -- a slow worker does not set the pace -----------------------------------------------------------------------
@pytest.mark.slow  # compares step rates as ratios a sleep dominates, so it runs beside another test file (make test)
def test_a_slow_worker_does_not_set_the_pace(tmp_path):
    """Every worker sleeps 50 ms per step, one of three 4x as long (the sleep dominates the step, so the rates
    compare on a loaded machine). Under ps the fast workers keep >= 0.8 of their rate without the slow one;
    under DDP the same delay brings every rank down to the slow pace."""
    delay, factor = 0.05, 4.0
    run = [*TOY, "++trainer.limit_train_batches=40", "data.batch_size=48", "test=false", *SLOW,
           f"+callbacks.slow.delay_s={delay}", f"+callbacks.slow.factor={factor}"]
    train_run(tmp_path / "base", *run, "trainer=ps", "trainer.devices=4")
    train_run(tmp_path / "slow", *run, "trainer=ps", "trainer.devices=4", "+callbacks.slow.slow_ranks=[3]")
    train_run(tmp_path / "ddp", *run, "trainer=ddp", "trainer.devices=3", "+callbacks.slow.slow_ranks=[2]")
    base, slow, ddp = (read_rates(tmp_path / r) for r in ("base", "slow", "ddp"))
    undisturbed = sum(base[r] for r in (1, 2, 3)) / 3
    for fast in (1, 2):
        assert slow[fast] >= 0.8 * undisturbed, (slow, base)
    assert slow[3] < 0.5 * undisturbed  # the slow worker really was slow
    slow_pace = 1 / (delay * factor)  # the most steps per second the slow rank can make
    assert all(rate <= 1.1 * slow_pace for rate in ddp.values()), ddp
    assert max(ddp.values()) < 0.5 * min(slow[1], slow[2])


@pytest.mark.slow
def test_a_worker_mid_step_at_the_end_gets_done_not_a_dead_server(tmp_path):
    """One worker sleeps 5 s per step, the other 0.02 s: the fast one applies the planned updates while the slow
    one is mid-step. The server waits for the slow worker's last push and answers DONE before it exits, so both
    workers leave as finished and the job exits 0 (a server that exited first would look dead to it)."""
    proc = train_run(tmp_path / "run", *TOY, "trainer.devices=3", "trainer=ps", "++trainer.limit_train_batches=30",
                     "test=false", *SLOW, "+callbacks.slow.delay_s=0.02", "+callbacks.slow.factor=250",
                     "+callbacks.slow.slow_ranks=[2]")
    log = (tmp_path / "run" / "train.log").read_text()
    assert log.count("left: it finished") == 2, log[-3000:]
    assert "error:" not in proc.stderr, proc.stderr[-3000:]


# -- launch forms ----------------------------------------------------------------------------------------------
def joined(run_dir: Path) -> int:
    return (run_dir / "train.log").read_text().count(" joined at ")


@pytest.mark.slow
def test_torchrun_one_node(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3", str(ROOT / "src/train.py"),
         "trainer=ps", "trainer.devices=3", *TOY, "++trainer.limit_train_batches=6", f"paths.log_dir={tmp_path}/logs"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = (tmp_path / "logs" / "train" / "runs").iterdir()
    assert "torchrun" in run.name and joined(run) == 2
    assert (run / "checkpoints" / "last.ckpt").is_file()


def launch_all(envs: list[dict], args, log_dir: Path) -> None:
    with Processes() as procs:
        for i, env in enumerate(envs):
            procs.start(f"launch {i}", [sys.executable, str(ROOT / "src/train.py"), *args(i)],
                        log=log_dir / f"launch{i}.log", cwd=ROOT, env={**os.environ, **env})
        codes = procs.wait(300, f"all {len(envs)} launches to train and exit")
        assert list(codes.values()) == [0] * len(envs), procs.report()


@pytest.mark.slow
def test_srun_tasks(tmp_path):
    """Three tasks with the variables srun sets: rank 0 serves, two workers join it; one run directory."""
    job_id = str(910000 + os.getpid() % 1000)
    common = {"SLURM_NTASKS": "3", "SLURM_NTASKS_PER_NODE": "3", "SLURM_NODEID": "0", "SLURM_JOB_ID": job_id,
              "SLURM_JOB_NAME": "train", "SLURM_NODELIST": "127.0.0.1", "MASTER_PORT": str(free_port())}
    envs = [{**common, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)} for r in range(3)]
    launch_all(envs, lambda r: ["trainer=ps", "trainer.devices=3", *TOY, "++trainer.limit_train_batches=6",
                                f"paths.log_dir={tmp_path}/logs"], tmp_path)
    (run,) = (tmp_path / "logs" / "train" / "runs").iterdir()
    assert f"slurm_{job_id}" in run.name and joined(run) == 2
    assert (run / "checkpoints" / "last.ckpt").is_file()


@pytest.mark.slow
def test_two_nodes_over_loopback(tmp_path):
    """NODE_RANK 0 and 1, two processes each: node 0 holds the server and a worker, node 1 two workers (a global
    batch of 48: 16 per worker)."""
    port = str(free_port())
    envs = [{"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "NODE_RANK": str(node)} for node in (0, 1)]
    launch_all(envs, lambda node: ["trainer=ps", "trainer.devices=2", "trainer.num_nodes=2", *TOY,
                                   "data.batch_size=48", "++trainer.limit_train_batches=6", f"hydra.run.dir={tmp_path}/node{node}"],
               tmp_path)
    assert joined(tmp_path / "node0") == 3
    assert (tmp_path / "node0" / "checkpoints" / "last.ckpt").is_file()
    assert not (tmp_path / "node1" / "checkpoints").exists()  # only the chief writes


# -- evaluation: exact, and eval.py reads the checkpoint -------------------------------------------------------
@pytest.mark.slow
def test_eval_py_reproduces_the_ps_test_metric(tmp_path):
    """The chief tests alone over the whole set; src/eval.py on one device gets the same test/loss from the
    checkpoint, a full model state dict."""
    proc = train_run(tmp_path / "ps", "trainer=ps", "trainer.devices=3", *TOY, "++trainer.limit_train_batches=10")
    (ckpt,) = (tmp_path / "ps" / "checkpoints").glob("epoch_*.ckpt")
    evaluated = run_entry("eval", "experiment=toy", "trainer=cpu", f"ckpt_path={ckpt}", "extras.print_config=false",
                          "logger=csv", f"hydra.run.dir={tmp_path}/eval")
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]

    def test_loss(text: str) -> str:
        (line,) = [line for line in text.splitlines() if "test/loss" in line]
        return line.split()[-2]

    assert test_loss(evaluated.stdout) == test_loss(proc.stdout)


# -- accuracy: async ends within a few points of DDP on the same samples --------------------------------------
@pytest.mark.slow
@pytest.mark.serial  # staleness grows with the machine's load
def test_async_ps_reaches_ddps_test_accuracy_on_the_same_samples(tmp_path):
    """The default model and data (Fashion-MNIST MLP, Adam, real data): 1 server + 3 async workers against DDP on 3
    ranks, both two epochs of a 192-sample global batch (64 per worker or rank), so the same samples and the same
    number of global steps. Test accuracy ends within 4 points: asynchronous updates land in a different order
    on every run, and the spread between machines is wider than on one (figures: docs/parameter-server.md), so it
    also runs alone (serial). Validation runs on the whole set: the checkpoint tested is the better epoch, not
    the one a few batches happened to favour."""
    common = ["trainer.accelerator=cpu", "data.batch_size=192", "trainer.max_epochs=2",
              "extras.print_config=false", "callbacks.metric_plot=null", "logger=csv"]
    train_run(tmp_path / "ps", "trainer=ps", "trainer.devices=4", *common)
    train_run(tmp_path / "ddp", "trainer=ddp", "trainer.devices=3", *common)
    steps = [torch.load(tmp_path / r / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
             for r in ("ps", "ddp")]
    assert steps[0] == steps[1], steps
    ps, ddp = (final_test_accuracy(tmp_path / r) for r in ("ps", "ddp"))
    staleness = logged_series(tmp_path / "ps", "ps/staleness")  # in the message: what the updates saw
    assert min(ps, ddp) > 0.75 and abs(ps - ddp) <= 0.04, (ps, ddp, staleness)


def logged_series(run_dir: Path, key: str) -> list[float]:
    (metrics,) = run_dir.rglob("metrics.csv")
    return [float(row[key]) for row in csv.DictReader(metrics.open()) if row.get(key)]


def final_test_accuracy(run_dir: Path) -> float:
    return logged_series(run_dir, "test/acc")[-1]
