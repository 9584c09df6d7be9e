"""One data order for every world size: a run killed at one number of ranks resumes on another and ends where
an uninterrupted one-process run ends, within float rounding (the all-reduce sums in another order).

Real processes and real SIGKILLs. No dropout and no augmentation: those draw from each rank's own stream,
which cannot carry over to another number of ranks (docs/faults.md). The global batch, 96, splits over 1, 2,
3 and 4 ranks. ``tests/test_ddp.py`` shows the sampler's slices and DDP x2 against one process directly.
"""

from __future__ import annotations

import csv
import os
import signal
import sys
import time

import psutil
import pytest
import torch
from lightning.fabric.plugins.environments.lightning import find_free_network_port

from tests.helpers.config import ROOT
from tests.helpers.training_runs import (
    TRAIN,
    final_weights,
    finish,
    launch,
    run_dirs,
    start,
    wait_for_checkpoint,
)

pytestmark = [pytest.mark.slow, pytest.mark.faults]

# 2 epochs of 12 global batches; a periodic last.ckpt every 3 steps; each step slowed so the kill lands mid-epoch
SAME_SAMPLES = ["model.net.dropout=0", "data.augment=false", "data.batch_size=96", "trainer.max_epochs=2",
                "++trainer.limit_train_batches=12"]
SLOWED = ["+callbacks.slow._target_=src.engine.callbacks.slow_rank.SlowRank", "+callbacks.slow.delay_s=0.05"]


def kill_after_first_checkpoint(log_dir, *extra: str) -> None:
    proc = start(log_dir, *SAME_SAMPLES, *SLOWED, *extra)
    assert wait_for_checkpoint(proc, log_dir), f"no checkpoint before the run ended: {finish(proc)}"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    time.sleep(0.2)  # the kernel drops the run dir's lock with the last process


def assert_ends_like(reference, run_dir) -> None:
    expected, got = final_weights(reference), final_weights(run_dir)
    stopped = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
    assert stopped == 24, stopped
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def epoch_train_losses(run_dir) -> list[float]:
    (metrics,) = run_dir.rglob("metrics.csv")
    return [float(row["train/loss"]) for row in csv.DictReader(metrics.open()) if row.get("train/loss")]


def test_killed_at_4_ranks_the_same_command_on_2_resumes_it(tmp_path, reference_runs):
    """The re-run changes only ``trainer.devices``: it continues the killed run in its own directory and says
    in one line what carried over. The killed epoch's logged training loss is the mean over all its batches:
    the 4 ranks' running sums, merged onto rank 0 of 2."""
    reference = reference_runs(*SAME_SAMPLES)
    log_dir = tmp_path / "runs"
    kill_after_first_checkpoint(log_dir, "trainer=ddp", "trainer.devices=4")
    (killed,) = run_dirs(log_dir)
    step = torch.load(killed / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
    assert 0 < step < 24, step

    again = start(log_dir, *SAME_SAMPLES, *SLOWED, "trainer=ddp", "trainer.devices=2")
    assert finish(again) == 0, again.stderr_text[-3000:]
    assert run_dirs(log_dir) == [killed]
    log = (killed / "train.log").read_text()
    assert "Resuming a checkpoint of 4 rank(s) on 2: the weights, the optimizer state and the position" in log
    assert_ends_like(reference, killed)
    losses, expected = epoch_train_losses(killed), epoch_train_losses(reference)
    assert len(losses) == len(expected) == 2
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-4, atol=0)


def test_killed_in_one_process_resumes_on_3_ranks_with_ckpt_path(tmp_path, reference_runs):
    """The killed epoch's logged training loss counts the one saved rank's batches once, not once per new rank."""
    reference = reference_runs(*SAME_SAMPLES)
    kill_after_first_checkpoint(tmp_path / "one")
    (killed,) = run_dirs(tmp_path / "one")
    resumed = start(tmp_path / "three", *SAME_SAMPLES, "trainer=ddp", "trainer.devices=3",
                    f"ckpt_path={killed / 'checkpoints' / 'last.ckpt'}")
    assert finish(resumed) == 0, resumed.stderr_text[-3000:]
    (run_dir,) = run_dirs(tmp_path / "three")
    assert_ends_like(reference, run_dir)
    losses, expected = epoch_train_losses(run_dir), epoch_train_losses(reference)
    assert len(losses) == len(expected) == 2
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-4, atol=0)


def elastic_node(log_dir, port: int, hosts_rendezvous: bool):
    """One node of ``torchrun --nnodes=1:2`` (one process per node) on loopback, in its own session. torch's
    rendezvous store sharing is off: with it, a node joining a world whose rank 0 stays rank 0 waits for a
    master address nobody publishes (docs/faults.md)."""
    conf = f"is_host={str(hosts_rendezvous).lower()},last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=3"
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc_per_node=1", "--max-restarts=3",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=elastic", f"--rdzv-conf={conf}",
               "--monitor-interval=0.5", str(ROOT / "src" / "train.py"), *TRAIN, *SAME_SAMPLES,
               "+callbacks.slow._target_=src.engine.callbacks.slow_rank.SlowRank", "+callbacks.slow.delay_s=0.6",
               "trainer=ddp", "trainer.devices=1", "trainer.num_nodes=2", "trainer.strategy.sigterm_check_every_n_batches=1",
               f"paths.log_dir={log_dir}"]
    return launch(command, env={**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})


def wait_for_line(log_dir, text: str, node, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not any(text in (d / "train.log").read_text() for d in run_dirs(log_dir) if (d / "train.log").is_file()):
        assert node.poll() is None and time.monotonic() < deadline, f"no {text!r} in the run's log"
        time.sleep(0.1)


def test_an_elastic_torchrun_loses_a_node_goes_on_alone_and_takes_it_back(tmp_path, reference_runs):
    """Two torchrun agents, ``--nnodes=1:2``. Node 1 (agent and worker) is killed mid-epoch: node 0 restarts
    at one node, says so in one line and resumes from last.ckpt. Node 1 started again joins: both restart at
    two nodes and resume. The run ends where an uninterrupted one-process run ends, within float rounding."""
    reference = reference_runs(*SAME_SAMPLES)
    log_dir, port = tmp_path / "runs", find_free_network_port()
    first = elastic_node(log_dir, port, hosts_rendezvous=True)
    second = elastic_node(log_dir, port, hosts_rendezvous=False)
    again = None
    try:
        assert wait_for_checkpoint(first, log_dir), "no checkpoint before the run ended"
        node = psutil.Process(second.pid)
        for process in [*node.children(recursive=True), node]:  # the whole node: its agent and its worker
            process.kill()
        second.wait(timeout=60)
        wait_for_line(log_dir, "torchrun started 1 node(s) of 1 process(es), not trainer.num_nodes=2", first)
        again = elastic_node(log_dir, port, hosts_rendezvous=False)
        assert finish(first, timeout=300) == 0, first.stderr_text[-3000:]
        assert finish(again, timeout=300) == 0, again.stderr_text[-3000:]
    finally:
        for node in (first, second, again):
            if node is not None and node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
    (run_dir,) = run_dirs(log_dir)
    log = (run_dir / "train.log").read_text()
    assert "Resuming a checkpoint of 2 rank(s) on 1" in log and "Resuming a checkpoint of 1 rank(s) on 2" in log
    assert "status: finished" in (run_dir / "status.yaml").read_text()
    assert_ends_like(reference, run_dir)
