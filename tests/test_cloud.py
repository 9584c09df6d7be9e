"""SkyPilot task, per-node torchrun script, ssh-hosts launch and kill-orphans, proven on this machine.

No cloud and no ssh host: SkyPilot's own loader validates the task offline; "nodes" are processes on
127.0.0.1; a stand-in for ssh runs each host's command line here, through a shell as sshd would.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from tests.helpers.config import ROOT
from tests.helpers.processes import Processes, free_port

TASK = ROOT / "scripts" / "cloud" / "ec2.yaml"
TINY = ["trainer.accelerator=cpu", "trainer.max_epochs=1", "++trainer.limit_train_batches=6",
        "++trainer.limit_val_batches=2", "++trainer.limit_test_batches=2", "extras.print_config=false"]
# nothing may leave this machine: any HTTP(S) attempt goes to a closed loopback port; no usage reports
OFFLINE = {"HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9", "NO_PROXY": "",
           "SKYPILOT_DISABLE_USAGE_COLLECTION": "1"}
# the node layout node_train.sh (and torchrun: also PET_*) reads before SkyPilot's variables: a test process's own
# (left by an earlier in-process run, say) would override the node's rank, address or process count
NODE_LAYOUT = ("NNODES", "NODE_RANK", "MASTER_ADDR", "NPROC_PER_NODE", "RUN_ID", "WORLD_SIZE", "RANK", "LOCAL_RANK",
               "GROUP_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "BASH_ENV")


def skypilot_python() -> str | None:
    """An interpreter that has SkyPilot: this one, or `make cloud-install`'s .venv-cloud."""
    if importlib.util.find_spec("sky") is not None:
        return sys.executable
    venv = ROOT / ".venv-cloud" / "bin" / "python"
    return str(venv) if venv.is_file() else None


def dump_params(tmp_path: Path) -> list[str]:
    return ["+callbacks.rank_params._target_=tests.helpers.rank_dump.SaveRankParams",
            f"+callbacks.rank_params.dirpath={tmp_path / 'params'}"]


def assert_identical_params(params_dir: Path, world_size: int = 2) -> None:
    states = [torch.load(params_dir / f"params_rank{r}.pt") for r in range(world_size)]
    assert states[0].keys() == states[1].keys()
    for name in states[0]:
        assert torch.equal(states[0][name], states[1][name]), f"{name} differs between the nodes"


@pytest.mark.fast
def test_task_file_validates_with_skypilots_loader():
    """SkyPilot's own loader accepts the task (default: 1 node of 4 x A10G) and its 2-node spot variant."""
    python = skypilot_python()
    if python is None:
        if os.environ.get("CI"):
            pytest.fail("CI installs SkyPilot (.ci/run: make cloud-install), but neither this Python nor .venv-cloud has it")
        pytest.skip("SkyPilot is not installed: `make cloud-install` (the `cloud` extra, in .venv-cloud)")
    check = f"""
import sky, yaml
task = sky.Task.from_yaml({str(TASK)!r})
(res,) = task.resources
assert task.num_nodes == 1 and res.accelerators == {{"A10G": 4}} and not res.use_spot, (task.num_nodes, res)
assert "make install" in task.setup and "scripts/cloud/node_train.sh" in task.run
config = yaml.safe_load(open({str(TASK)!r}))
config["num_nodes"] = 2
config["resources"]["use_spot"] = True
task = sky.Task.from_yaml_config(config)
(res,) = task.resources
assert task.num_nodes == 2 and res.use_spot and str(res.cloud) == "AWS", (task.num_nodes, res)
print("ok", sky.__version__)
"""
    proc = subprocess.run([python, "-c", check], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **OFFLINE}, cwd=ROOT)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


@pytest.mark.slow
def test_node_script_trains_two_nodes_over_loopback(tmp_path):
    """node_train.sh, run twice with the variables SkyPilot sets on node 0 and node 1: identical weights."""
    skypilot = {"SKYPILOT_NUM_NODES": "2", "SKYPILOT_NODE_IPS": "127.0.0.1\n127.0.0.1",
                "SKYPILOT_NUM_GPUS_PER_NODE": "0", "SKYPILOT_TASK_ID": "sky-test_lhd_1",
                "MASTER_PORT": str(free_port()), "PYTHON": sys.executable}
    # what the script reads from the environment comes from SkyPilot's variables alone, not from this process
    inherited = {k: v for k, v in os.environ.items() if k not in NODE_LAYOUT and not k.startswith("PET_")}
    with Processes() as procs:
        for rank in (0, 1):
            procs.start(f"node {rank}", ["bash", str(ROOT / "scripts/cloud/node_train.sh"), *TINY,
                                         *dump_params(tmp_path), f"paths.log_dir={tmp_path}/logs"],
                        log=tmp_path / f"node{rank}.log", cwd=tmp_path,
                        env={**inherited, **skypilot, "SKYPILOT_NODE_RANK": str(rank)})
        codes = procs.wait(300, "both nodes to train and exit (node 0 hosts the rendezvous, node 1 joins it)")
        assert list(codes.values()) == [0, 0], procs.report()
        assert "node 1/2: 1 processes, master 127.0.0.1" in procs.output("node 1"), procs.report()
    assert_identical_params(tmp_path / "params")
    (run_dir,) = (tmp_path / "logs" / "train" / "runs").iterdir()  # both nodes named it from the task id
    assert run_dir.name.startswith("sky_sky-test_lhd_1_") and (run_dir / "checkpoints" / "last.ckpt").is_file()


def fake_ssh(bin_dir: Path) -> Path:
    """Stands in for ssh: drops the host and runs the command line in a shell, as sshd does."""
    bin_dir.mkdir(exist_ok=True)
    ssh = bin_dir / "ssh"
    ssh.write_text('#!/bin/sh\nshift\nexec sh -c "$*"\n')
    ssh.chmod(0o755)
    return ssh


@pytest.mark.slow
def test_launch_hosts_two_hosts_over_loopback(tmp_path):
    """`make launch-hosts HOSTS="127.0.0.1 127.0.0.1"`: one torchrun per host, ranks by position, identical weights."""
    args = " ".join([*TINY, *dump_params(tmp_path), f"paths.log_dir={tmp_path}/logs"])
    with Processes() as procs:
        procs.start("make launch-hosts", [
            "make", "--no-print-directory", "launch-hosts", "HOSTS=127.0.0.1 127.0.0.1",
            f"SSH={fake_ssh(tmp_path / 'bin')}", "SSH_OPTS=", f"REMOTE_DIR={ROOT}", "REMOTE_SETUP=true",
            f"PYTHON={sys.executable}", "NPROC_PER_NODE=1", f"MASTER_PORT={free_port()}", f"ARGS={args}"],
            log=tmp_path / "launch_hosts.log", cwd=ROOT)
        (code,) = procs.wait(300, "make launch-hosts: both hosts' torchrun to train and exit").values()
        assert code == 0, procs.report(lines=60)
        out = procs.output("make launch-hosts")
        assert "[node 0] node 0/2" in out and "[node 1] node 1/2" in out, procs.report(lines=60)
    assert_identical_params(tmp_path / "params")


def test_sync_copies_the_repo_but_not_ignored_files(tmp_path):
    """`make sync HOSTS=127.0.0.1`: rsync over the (stand-in) ssh puts the tracked tree in REMOTE_DIR, not logs/."""
    if shutil.which("rsync") is None:
        if os.environ.get("CI"):
            pytest.fail("CI installs rsync (.ci/run: make install, scripts/install.sh), but it is not on PATH")
        pytest.skip("rsync is not installed: `make install` installs it where apt is available")
    remote = tmp_path / "remote"
    (remote / "logs").mkdir(parents=True)
    (remote / "logs" / "keep.txt").write_text("a run on the host")  # ignored files on the host stay put
    proc = subprocess.run(["make", "--no-print-directory", "sync", "HOSTS=127.0.0.1", f"SSH={fake_ssh(tmp_path / 'bin')}",
                           "SSH_OPTS=", f"REMOTE_DIR={remote}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert (remote / "src" / "train.py").read_bytes() == (ROOT / "src" / "train.py").read_bytes()
    assert (remote / "scripts" / "cloud" / "node_train.sh").is_file() and not (remote / ".git").exists()
    assert (remote / "logs" / "keep.txt").read_text() == "a run on the host"
    assert not (remote / ".venv-cloud").exists() and not (remote / "data").exists()


@pytest.mark.slow
def test_kill_orphans_ends_orphaned_ranks_only(tmp_path):
    """torchrun's agent dies; its two ranks train on as orphans. kill-orphans ends them, not a bystander python."""
    pid_dir = tmp_path / "logs" / ".pids"
    with Processes() as procs:  # on the way out it ends the ranks too, which it saw while the agent lived
        agent = procs.start("torchrun", [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            str(ROOT / "src/train.py"), "trainer=ddp", "trainer.devices=2", "trainer.accelerator=cpu",
            "trainer.max_epochs=100", "extras.print_config=false", "logger=none", f"paths.log_dir={tmp_path}/logs"],
            log=tmp_path / "torchrun.log", cwd=ROOT)
        bystander = procs.start("bystander", [sys.executable, "-c", "import time; time.sleep(600)"],
                                log=tmp_path / "bystander.log")
        procs.wait_for(lambda: len(list(pid_dir.glob("*.json"))) == 2, 180, f"both ranks to register in {pid_dir}")
        ranks = [json.loads(p.read_text())["pid"] for p in pid_dir.glob("*.json")]
        kill_orphans = ["make", "--no-print-directory", "kill-orphans", f"PID_DIR={pid_dir}", f"PYTHON={sys.executable}"]

        first = subprocess.run(kill_orphans, cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert "0 orphaned rank(s)" in first.stdout, first.stdout + first.stderr  # their launcher is alive
        assert all(psutil.pid_exists(pid) for pid in ranks)

        agent.send_signal(signal.SIGKILL)  # the launcher dies; the ranks are reparented and keep training
        procs.wait(30, "the SIGKILLed torchrun agent to exit", names=["torchrun"])
        time.sleep(2)
        assert all(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in ranks)

        second = subprocess.run(kill_orphans, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert second.returncode == 0 and "ended 2 orphaned rank(s)" in second.stdout, second.stdout + second.stderr
        assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in ranks)
        assert bystander.poll() is None  # the bystander python is untouched
        assert not list(pid_dir.glob("*.json"))
