"""Bad input seen by one rank of several, and a rendezvous that never comes: one line for the whole job.

Real processes through the CLI, 2 CPU ranks over gloo; addresses are loopback only.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from lightning.fabric.plugins.environments.lightning import find_free_network_port

from tests.helpers.config import ROOT
from tests.helpers.entry import run_entry
from tests.test_bad_input import TOY, one_line_exit_2


def run_job(*overrides: str, timeout: int) -> subprocess.CompletedProcess:
    """``python src/train.py overrides...`` in its own session: on a timeout every rank of the job is killed
    (an orphaned child rank would otherwise outlive the test, holding the output pipes)."""
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "src" / "train.py"), *overrides],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=60)  # bounded too: a process of another session could hold the pipes
        pytest.fail(f"the job hung for {timeout} s (a rank never exited):\n{err[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.faults
@pytest.mark.slow
def test_missing_data_is_refused_before_any_rank_starts(tmp_path):
    """The data is looked for before any rank starts (the pre-flight runs prepare_data): its one line is all
    stderr holds, with no Lightning start-up line before it, no rank is started, and no run dir is left."""
    (tmp_path / "empty").mkdir()
    proc = run_job(
        "trainer=ddp",
        "trainer.devices=2",
        "trainer.accelerator=cpu",
        "trainer.max_epochs=1",
        "++trainer.limit_train_batches=2",
        "extras.print_config=false",
        f"paths.data_dir={tmp_path}/empty",
        "data.download=false",
        f"data.system_dir={tmp_path}/nowhere",
        f"paths.log_dir={tmp_path}/logs",
        timeout=180,
    )
    line = one_line_exit_2(proc)
    assert "fashion_mnist not found" in line and "downloads are disabled" in line
    assert proc.stderr.strip().splitlines() == [line]
    assert "MEMBER" not in proc.stdout + proc.stderr and "GPU available" not in proc.stdout + proc.stderr
    assert not list((tmp_path / "logs").glob("train/runs/*/.hydra"))


def start_second_node(tmp_path, env: dict):
    """Node 1 of a two-node toy DDP run, alone: node 0 never starts."""
    return run_entry("train", *TOY, "trainer=ddp", "trainer.devices=1", "trainer.num_nodes=2",
                     f"hydra.run.dir={tmp_path}/run", env=env, timeout=120)


@pytest.mark.faults
@pytest.mark.fast
def test_rendezvous_wait_is_bounded(tmp_path):
    """Node 1 of 2 whose node 0 never starts: one line naming MASTER_ADDR:MASTER_PORT after RENDEZVOUS_TIMEOUT
    seconds (not torch's 30 minutes of retries and C++ frames)."""
    port = find_free_network_port()  # free on every interface, so nothing listens on 127.0.0.2 either
    env = {"NODE_RANK": "1", "MASTER_ADDR": "127.0.0.2", "MASTER_PORT": str(port), "RENDEZVOUS_TIMEOUT": "3"}
    started = time.monotonic()
    proc = start_second_node(tmp_path, env)
    line = one_line_exit_2(proc)
    assert f"127.0.0.2:{port}" in line and "RENDEZVOUS_TIMEOUT" in line
    assert time.monotonic() - started < 90


@pytest.mark.faults
@pytest.mark.fast
def test_rendezvous_needs_master_addr_and_port(tmp_path, monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    proc = start_second_node(tmp_path, {"NODE_RANK": "1"})
    assert "MASTER_ADDR and MASTER_PORT are not both set" in one_line_exit_2(proc)


@pytest.mark.faults
@pytest.mark.fast
def test_several_nodes_without_a_launcher_fail_in_one_line_on_node_0(tmp_path, monkeypatch):
    """``trainer.num_nodes=2`` with no launcher settings: one line and exit 2 at once, where node 0 used to
    wait without a word (the process-group start has no limit there)."""
    for name in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
        monkeypatch.delenv(name, raising=False)
    started = time.monotonic()
    line = one_line_exit_2(start_second_node(tmp_path, {}))
    assert "trainer.num_nodes=2" in line and "torchrun --nnodes=2" in line, line
    assert time.monotonic() - started < 180  # far under the process-group start's wait; loaded CI machines are slow


@pytest.mark.fast
def test_wait_for_listener_sees_a_late_master():
    from src.engine.runtime.rendezvous import wait_for_listener

    port = find_free_network_port()
    assert not wait_for_listener("127.0.0.2", port, timeout=0.5, interval=0.1)
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)

    def start_late() -> None:
        time.sleep(0.5)
        server.bind(("127.0.0.2", port))
        server.listen()

    thread = threading.Thread(target=start_late)
    thread.start()
    try:
        assert wait_for_listener("127.0.0.2", port, timeout=20, interval=0.1)
    finally:
        thread.join()
        server.close()


def test_config_error_is_printed_by_rank_zero_only(tmp_path):
    """torchrun/srun start every rank with the same command line: its error is said once, by global rank 0."""
    for rank, printed in (("0", 1), ("1", 0)):
        proc = run_entry(
            "train", "trainer=nope", f"hydra.run.dir={tmp_path}/run", env={"RANK": rank}, timeout=120
        )
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert len([ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]) == printed


@pytest.mark.fast
def test_torch_store_timeout_becomes_one_line():
    """A launcher that skips the pre-flight's bounded wait (torchrun, srun) still gets one line from torch's timeout."""
    from src.engine.utils.task import rendezvous_error

    err = RuntimeError(
        "The client socket has timed out after 15000ms while trying to connect to (127.0.0.2, 29517)."
    )
    message = str(rendezvous_error(err))
    assert "MASTER_ADDR:MASTER_PORT=127.0.0.2:29517 within 15 s" in message and "; fix: " in message


@pytest.mark.fast
def test_peer_failure_is_recognised():
    from src.engine.runtime.exit_cleanup import peer_failed

    gloo = "[../third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:52940"
    assert peer_failed(RuntimeError(gloo))
    try:
        try:
            raise RuntimeError(gloo)
        except RuntimeError as inner:
            raise ValueError("while tearing down") from inner
    except ValueError as outer:
        assert peer_failed(outer)
    assert not peer_failed(RuntimeError("CUDA out of memory"))
