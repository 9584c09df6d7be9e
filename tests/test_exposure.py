"""A one-node DDP run listens on loopback only: the rendezvous goes through a file, gloo binds to ``lo``.
The file's folder is gone once the run has ended."""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys

import psutil
import pytest

from src.engine.runtime import local_store
from tests.helpers.training_runs import finish, start, wait_for_checkpoint


def listening(proc: psutil.Process) -> list[str]:
    return [c.laddr.ip for c in proc.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]


@pytest.mark.slow
@pytest.mark.faults
def test_one_node_ddp_opens_no_port_outside_loopback(tmp_path):
    proc = start(tmp_path, "trainer=ddp", "trainer.devices=2", "trainer.max_epochs=20")
    try:
        assert wait_for_checkpoint(proc, tmp_path)
        rank0 = psutil.Process(proc.pid)
        addresses = [ip for p in (rank0, *rank0.children()) for ip in listening(p)]
        assert addresses, "gloo listens for its peers: expected loopback sockets"
        assert all(ipaddress.ip_address(ip).is_loopback for ip in addresses), addresses
    finally:
        proc.kill()
        for child in psutil.Process(proc.pid).children() if proc.poll() is None else []:
            child.kill()
        finish(proc)


@pytest.mark.slow
@pytest.mark.parametrize("trainer", ["ddp", "ddp_spawn"])
def test_a_one_node_run_leaves_no_rendezvous_folder_behind(tmp_path, trainer):
    temp = tmp_path / "TMPDIR"  # this run's own temp dir: other tests' runs make store folders in theirs
    temp.mkdir()
    proc = start(tmp_path, f"trainer={trainer}", "trainer.devices=2", "trainer.max_epochs=1",
                 "trainer.limit_train_batches=4", env={**os.environ, "TMPDIR": str(temp)})
    assert finish(proc) == 0, proc.stderr_text[-3000:]
    assert list(temp.glob("ddp-store-*")) == []


@pytest.mark.fast
def test_the_store_folder_outlives_a_rank_that_still_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(local_store, "RANKS_EXIT_WAIT_S", 0.2)
    folder = tmp_path / "ddp-store-x"
    folder.mkdir()
    (folder / "store").write_bytes(b"")
    rank = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        assert not local_store.remove_when_ranks_end(str(folder), [rank])
        assert (folder / "store").exists()  # a live rank's store calls would hang without its file
    finally:
        rank.communicate(b"")  # it ends once its stdin closes
    assert local_store.remove_when_ranks_end(str(folder), [rank])
    assert not folder.exists()
