"""A rank's flight-recorder record comes out through torch's public worker server, for one request only."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.helpers.processes import free_port

pytestmark = pytest.mark.fast

# A fresh process: torch reads TORCH_FR_BUFFER_SIZE when it makes the group, and this one makes its own.
SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch, torch.distributed as dist
    from src.engine.runtime import flight_recorder
    flight_recorder.record_collectives("gloo", "unused")
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0, world_size=1)
    dist.all_reduce(torch.ones(3))
    dist.broadcast(torch.ones(2), src=0)
    first = flight_recorder.write(sys.argv[2], 0)
    second, nccl = flight_recorder.dump(flight_recorder.COLLECTIVES, flight_recorder.NCCL)
    dist.destroy_process_group()
    print(json.dumps({"written": [str(p) for p in first], "first": json.loads(first[0].read_text()),
                      "second": json.loads(second), "nccl": json.loads(nccl),
                      "socket_env": os.environ.get("TORCH_WORKER_SERVER_SOCKET")}))
""")


def test_the_record_lists_the_rank_collectives_in_order_and_the_server_is_stopped_after(tmp_path):
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(free_port()), str(tmp_path / "records")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["written"] == [str(tmp_path / "records" / "rank_0.json")]  # gloo only: NCCL's ring has no entries
    assert "entries" not in out["nccl"]
    entries = out["first"]["entries"]
    names = [entry["profiling_name"] for entry in entries]
    assert names == ["gloo:all_reduce", "gloo:broadcast"], names
    assert [entry["collective_seq_id"] for entry in entries] == [1, 2]
    assert all(entry["process_group"][1] == "default_pg" for entry in entries)
    assert out["second"]["entries"] == entries  # a second dump starts its own server: the first one was stopped
    assert out["socket_env"] is None  # the socket the server listened on is not left in the environment
