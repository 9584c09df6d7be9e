"""Bad input seen by one rank of several, and a rendezvous that never comes: one line for the whole job.

Real processes through the CLI, 2 CPU ranks over gloo; addresses are loopback only.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from src.strategies.ports import find_free_port
from tests.helpers.entry import run_entry
from tests.test_bad_input import TOY, one_line_exit_2


@pytest.mark.faults
@pytest.mark.slow
def test_data_error_on_rank_zero_only(tmp_path):
    """prepare_data runs on rank 0 only: it finds no data and says so; rank 1, waiting for it in a barrier, loses
    its peer and stops quietly instead of printing gloo's "Connection closed by peer" traceback."""
    (tmp_path / "empty").mkdir()
    proc = run_entry(
        "train",
        "trainer=ddp",
        "trainer.devices=2",
        "trainer.accelerator=cpu",
        "trainer.max_epochs=1",
        "++trainer.limit_train_batches=2",
        "extras.print_config=false",
        f"paths.data_dir={tmp_path}/empty",
        "data.download=false",
        f"data.system_dir={tmp_path}/nowhere",
        f"hydra.run.dir={tmp_path}/run",
        timeout=240,
    )
    line = one_line_exit_2(proc)
    assert "fashion_mnist not found" in line
    assert "MEMBER: 2/2" in proc.stderr  # both ranks had started: rank 1 was really there
    assert "Connection closed" not in proc.stderr
    quiet = [ln for ln in proc.stderr.splitlines() if ln.startswith("rank 1:")]
    assert len(quiet) <= 1, proc.stderr[-2000:]


@pytest.mark.faults
@pytest.mark.fast
def test_rendezvous_wait_is_bounded(tmp_path):
    """Node 1 of 2 whose node 0 never starts: one line naming MASTER_ADDR:MASTER_PORT after RENDEZVOUS_TIMEOUT
    seconds (not torch's 30 minutes of retries and C++ frames)."""
    port = find_free_port("127.0.0.2")  # nothing listens there once the probe socket is closed
    env = {"NODE_RANK": "1", "MASTER_ADDR": "127.0.0.2", "MASTER_PORT": str(port), "RENDEZVOUS_TIMEOUT": "3"}
    started = time.monotonic()
    proc = run_entry(
        "train",
        *TOY,
        "trainer=ddp",
        "trainer.devices=1",
        "trainer.num_nodes=2",
        f"hydra.run.dir={tmp_path}/run",
        env=env,
        timeout=120,
    )
    line = one_line_exit_2(proc)
    assert f"127.0.0.2:{port}" in line and "RENDEZVOUS_TIMEOUT" in line
    assert time.monotonic() - started < 90


@pytest.mark.faults
@pytest.mark.fast
def test_rendezvous_needs_master_addr_and_port(tmp_path, monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    proc = run_entry(
        "train",
        *TOY,
        "trainer=ddp",
        "trainer.devices=1",
        "trainer.num_nodes=2",
        f"hydra.run.dir={tmp_path}/run",
        env={"NODE_RANK": "1"},
        timeout=120,
    )
    assert "MASTER_ADDR and MASTER_PORT" in one_line_exit_2(proc)


@pytest.mark.fast
def test_wait_for_listener_sees_a_late_master():
    from src.strategies.ports import wait_for_listener

    port = find_free_port("127.0.0.2")
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
