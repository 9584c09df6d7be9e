"""A one-node DDP run listens on loopback only: the rendezvous goes through a file, gloo binds to ``lo``."""

from __future__ import annotations

import ipaddress

import psutil
import pytest

from tests.helpers.training_runs import finish, start, wait_for_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.faults]


def listening(proc: psutil.Process) -> list[str]:
    return [c.laddr.ip for c in proc.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]


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
