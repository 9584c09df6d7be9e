"""AtomicCheckpointIO: same-directory temp file + fsync + os.replace, stale temp files cleaned, weights_only loads.

The kill -9 loop starts real processes that save a 32 MB checkpoint over and over and SIGKILLs them at random
moments, with TMPDIR on /dev/shm (tmpfs: another filesystem than the checkpoint's), the setting in which
Lightning's own ``_atomic_save`` (fsspec temp file in TMPDIR, then ``shutil.move``: a truncating copy across
filesystems) leaves a torn ``last.ckpt``.
"""

from __future__ import annotations

import builtins
import hashlib
import os
import pickle
import queue
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import hydra
import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy

from src.engine.checkpointing.io import (
    AtomicCheckpointIO,
    AtomicCheckpointIODefault,
    cleanup_stale_temp_files,
    temp_prefix,
)
from src.engine.strategies.dp.strategy import DataParallelStrategy
from src.engine.utils.errors import CheckpointError
from src.train import train
from tests.helpers.config import ROOT

pytestmark = pytest.mark.faults


def _temp_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.name.endswith(".tmp"))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# -- unit: how a save is written ------------------------------------------------------------------------
@pytest.mark.fast
def test_save_writes_temp_beside_target_fsyncs_then_replaces(tmp_path, monkeypatch):
    other_tmp = tmp_path / "TMPDIR"
    other_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(other_tmp))  # where Lightning's fsspec temp file would go
    events: list[tuple] = []
    real_mkstemp, real_fsync, real_replace = tempfile.mkstemp, os.fsync, os.replace

    def mkstemp(*args, **kwargs):
        fd, name = real_mkstemp(*args, **kwargs)
        events.append(("mkstemp", Path(name)))
        return fd, name

    def fsync(fd):
        st = os.fstat(fd)
        events.append(("fsync", "dir" if os.path.isdir(f"/proc/self/fd/{fd}") else "file", st.st_ino))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", Path(src), Path(dst), os.stat(src).st_ino))
        real_replace(src, dst)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    dest = tmp_path / "run" / "checkpoints" / "last.ckpt"  # parents are created
    AtomicCheckpointIO().save_checkpoint({"w": torch.arange(10)}, dest)

    kinds = [e[0] for e in events]
    assert kinds == ["mkstemp", "fsync", "replace", "fsync"], events
    temp = events[0][1]
    assert temp.parent == dest.parent and temp.name.startswith(temp_prefix("last.ckpt")) and temp.suffix == ".tmp"
    assert events[1][1] == "file" and events[1][2] == events[2][3]  # the temp file itself was fsynced ...
    assert events[2][1:3] == (temp, dest)  # ... then renamed onto the target
    assert events[3][1] == "dir"  # and the rename made durable
    assert torch.equal(torch.load(dest, weights_only=True)["w"], torch.arange(10))
    assert list(other_tmp.iterdir()) == [] and _temp_files(dest.parent) == []
    umask = os.umask(0o022)
    os.umask(umask)
    assert dest.stat().st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's 0o600


@pytest.mark.fast
@pytest.mark.parametrize("fail_at", ["torch.save", "os.replace"])
def test_failed_save_keeps_previous_file_and_leaves_no_temp(tmp_path, monkeypatch, fail_at):
    dest = tmp_path / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint({"step": 1, "w": torch.ones(1000)}, dest)
    before = dest.read_bytes()
    if fail_at == "torch.save":  # a value torch.save cannot pickle, after 4 MB were already written
        checkpoint = {"step": 2, "big": torch.zeros(1 << 20), "bad": lambda: None}
    else:
        checkpoint = {"step": 2, "w": torch.zeros(1000)}

        def refuse(src, dst):
            raise OSError("disk went away")

        monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises((OSError, pickle.PicklingError, AttributeError, TypeError)):
        io.save_checkpoint(checkpoint, dest)
    assert dest.read_bytes() == before
    assert torch.load(dest, weights_only=True)["step"] == 1
    assert _temp_files(tmp_path) == []


@pytest.mark.fast
def test_stale_temp_files_are_removed_and_nothing_else(tmp_path):
    dead, me = _dead_pid(), os.getpid()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stale = [f".last.ckpt.{dead}.ab_c1234.tmp", f".epoch_003.ckpt.{dead}.zzzzzzzz.tmp", f".last.ckpt.{me}.q1w2e3r4.tmp"]
        kept = [
            f".last.ckpt.{sleeper.pid}.abcdefgh.tmp",  # a save in progress in a live process
            "last.ckpt.tmp", ".last.ckpt.tmp", "notes.tmp",  # not this scheme
            f".last.ckpt.{dead}.abc.tmp", f".last.ckpt.{dead}.ABCDEFGH.tmp",  # wrong random part
            f"last.ckpt.{dead}.abcdefgh.tmp", f".last.ckpt.{dead}.abcdefgh.tmpx", "epoch_001.ckpt",
        ]
        for name in stale + kept:
            (tmp_path / name).write_bytes(b"x")
        (tmp_path / f".dir.{dead}.abcdefgh.tmp").mkdir()  # a directory is never removed
        kept.append(f".dir.{dead}.abcdefgh.tmp")

        assert sorted(p.name for p in cleanup_stale_temp_files(tmp_path)) == sorted(stale)
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept)
        for name in stale:  # a save into the folder cleans up too
            (tmp_path / name).write_bytes(b"x")
        AtomicCheckpointIO().save_checkpoint({"x": 1}, tmp_path / "last.ckpt")
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*kept, "last.ckpt"])
    finally:
        sleeper.kill()
        sleeper.wait()
    assert cleanup_stale_temp_files(tmp_path / "missing") == []


# -- unit: loads run no code ----------------------------------------------------------------------------
class _WritesMarker:
    """Unpickling this calls ``exec``, which writes ``marker``: harmless stand-in for ``os.system``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return builtins.exec, (f"open({str(self.marker)!r}, 'w').close()",)


@pytest.mark.fast
def test_load_passes_weights_only_true(tmp_path, monkeypatch):
    path = tmp_path / "c.ckpt"
    torch.save({"w": torch.ones(2)}, path)
    seen = []
    real_load = torch.load

    def spy(*args, **kwargs):
        seen.append(kwargs.get("weights_only", "missing"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    io = AtomicCheckpointIO()
    io.load_checkpoint(path)
    io.load_checkpoint(path, weights_only=None)  # what trainer.fit(ckpt_path=...) passes by default
    assert seen == [True, True]
    io.load_checkpoint(path, weights_only=False)  # only an explicit False opts out
    assert seen[-1] is False


@pytest.mark.fast
def test_load_refuses_a_checkpoint_that_runs_code(tmp_path):
    control, marker = tmp_path / "control", tmp_path / "marker"
    torch.save({"state_dict": {}, "evil": _WritesMarker(control)}, tmp_path / "control.ckpt")
    torch.load(tmp_path / "control.ckpt", weights_only=False)
    assert control.exists()  # the payload is real: a plain load runs it

    evil = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "evil": _WritesMarker(marker)}, evil)
    with pytest.raises(CheckpointError, match=r"evil\.ckpt holds Python objects other than tensors .*; fix: .*trust_checkpoint=true"):
        AtomicCheckpointIO().load_checkpoint(evil)
    assert not marker.exists()

    # the resume path: Trainer.fit(ckpt_path=...) -> strategy.checkpoint_io.load_checkpoint(weights_only=None)
    from lightning.pytorch.demos.boring_classes import BoringModel

    trainer = Trainer(plugins=[AtomicCheckpointIO()], max_epochs=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    with pytest.raises(CheckpointError):
        trainer.fit(BoringModel(), ckpt_path=evil)
    assert not marker.exists()


# -- wiring: every trainer config, and the strategy mixin ----------------------------------------------
@pytest.mark.fast
@pytest.mark.parametrize("trainer_cfg", ["default", "cpu", "ddp", "ddp_spawn", "dp", "pipeline", "fsdp"])
def test_every_trainer_config_saves_atomically(make_cfg, trainer_cfg):
    cfg = make_cfg("train", [f"trainer={trainer_cfg}", "trainer.accelerator=cpu"])
    trainer = hydra.utils.instantiate(cfg.trainer)
    assert type(trainer.strategy.checkpoint_io) is AtomicCheckpointIO


@pytest.mark.fast
def test_strategy_mixin_defaults_to_atomic_and_keeps_what_is_given():
    class Strategy(AtomicCheckpointIODefault, LightningDDPStrategy):
        pass

    assert type(Strategy().checkpoint_io) is AtomicCheckpointIO
    assert type(DataParallelStrategy().checkpoint_io) is AtomicCheckpointIO
    given = TorchCheckpointIO()
    assert Strategy(checkpoint_io=given).checkpoint_io is given
    wrapper = Strategy(checkpoint_io=AsyncCheckpointIO()).checkpoint_io  # an empty wrapper gets the atomic base
    assert isinstance(wrapper, AsyncCheckpointIO) and type(wrapper.checkpoint_io) is AtomicCheckpointIO
    # the default is not set in __init__, so trainer.plugins may still name a checkpoint_io (no "set twice")
    trainer = Trainer(strategy=Strategy(), plugins=[AtomicCheckpointIO()], accelerator="cpu", devices=1,
                      logger=False)
    assert type(trainer.strategy.checkpoint_io) is AtomicCheckpointIO


def test_project_resume_loads_through_atomic_io(make_cfg, monkeypatch):
    first = make_cfg("train", ["data=toy", "model=toy", "test=false"], subdir="first")
    _, objects = train(first)
    assert type(objects["trainer"].strategy.checkpoint_io) is AtomicCheckpointIO
    last = Path(first.paths.output_dir) / "checkpoints" / "last.ckpt"
    assert _temp_files(last.parent) == []

    calls = []
    real = AtomicCheckpointIO.load_checkpoint

    def spy(self, path, *args, **kwargs):
        calls.append((Path(path), kwargs.get("weights_only")))
        return real(self, path, *args, **kwargs)

    monkeypatch.setattr(AtomicCheckpointIO, "load_checkpoint", spy)
    second = make_cfg("train", ["data=toy", "model=toy", "test=false", f"ckpt_path={last}", "trainer.max_epochs=2"],
                      subdir="second")
    _, objects = train(second)
    assert calls and calls[0][0] == last  # a real project checkpoint resumes with weights_only loading
    assert objects["trainer"].global_step == 2 * objects["trainer"].num_training_batches


# -- kill -9 loop: real processes, SIGKILL at random moments -------------------------------------------
# A long-lived process imports torch once, then forks one writer per round (importing Lightning takes
# seconds; a fork takes milliseconds). The writer saves {"step", "payload" (32 MB), "sha256"} to last.ckpt
# in a loop and reports each completed save on stdout; the test SIGKILLs it at a random moment.
WRITER = r"""
import hashlib, os, sys
import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO
from src.engine.checkpointing.io import AtomicCheckpointIO

torch.set_num_threads(1)
io_class = {"atomic": AtomicCheckpointIO, "lightning": TorchCheckpointIO}[sys.argv[1]]
path, numel = sys.argv[2], int(sys.argv[3])
base = torch.arange(numel, dtype=torch.float32)
print("ready", flush=True)
while line := sys.stdin.readline():
    pid = os.fork()
    if pid == 0:
        try:
            io, step = io_class(), int(line)
            while True:
                payload = base + step
                digest = hashlib.sha256(payload.numpy().tobytes()).hexdigest()
                io.save_checkpoint({"step": step, "payload": payload, "sha256": digest}, path)
                os.write(1, f"saved {step}\n".encode())
                step += 1
        finally:
            os._exit(1)
    print(f"worker {pid}", flush=True)
    print(f"exit {os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}", flush=True)
"""
NUMEL = 8 * 1024 * 1024  # float32: a 32 MB checkpoint


def _check(ckpt: Path) -> int | None:
    """The step of a complete checkpoint, None for a torn or unreadable one."""
    try:
        saved = torch.load(ckpt, map_location="cpu", weights_only=True)
    except Exception:
        return None
    payload = saved["payload"]
    ok = hashlib.sha256(payload.numpy().tobytes()).hexdigest() == saved["sha256"] and payload.numel() == NUMEL
    return saved["step"] if ok else None


def kill_loop(io_name: str, folder: Path, kills: int, seed: int = 0) -> dict:
    """Run ``kills`` rounds of save-loop + SIGKILL with TMPDIR on /dev/shm; return what was found after each kill."""
    shm = Path(tempfile.mkdtemp(prefix="ckpt-kill-loop-", dir="/dev/shm"))
    ckpt = folder / "last.ckpt"
    folder.mkdir(parents=True, exist_ok=True)
    assert os.stat(shm).st_dev != os.stat(folder).st_dev, "TMPDIR must be another filesystem than the checkpoint"
    env = {**os.environ, "TMPDIR": str(shm), "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", WRITER, io_name, str(ckpt), str(NUMEL)], cwd=ROOT, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x.strip()) for x in proc.stdout], daemon=True).start()

    def expect(prefix: str) -> str:
        while not (line := lines.get(timeout=60)).startswith(prefix):
            pass
        return line

    rng = random.Random(seed)
    stats = {"kills": 0, "torn": 0, "went_back": 0, "killed_mid_save": 0, "temp_left_by_earlier_rounds": 0,
             "temp_files_in_TMPDIR": 0, "saves": 0}
    try:
        expect("ready")
        step, period = 0, None
        for _ in range(kills):
            proc.stdin.write(f"{step}\n")
            proc.stdin.flush()
            pid = int(expect("worker").split()[1])
            t0, last = time.monotonic(), int(expect("saved").split()[1])
            if period is None:  # calibrate: how long one save takes here
                expect("saved")
                last, period = last + 1, time.monotonic() - t0
            time.sleep(rng.uniform(0, 1.2 * period))
            os.kill(pid, signal.SIGKILL)
            while not (line := lines.get(timeout=60)).startswith("exit"):
                last = int(line.split()[1])
            assert line == f"exit {-signal.SIGKILL}", line
            stats["kills"] += 1
            stats["saves"] += last - step + 1
            found = _check(ckpt)
            if found is None:
                stats["torn"] += 1
            elif found < last:
                stats["went_back"] += 1
            temps = [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]
            stats["killed_mid_save"] += any(f".{pid}." in name for name in temps)
            stats["temp_left_by_earlier_rounds"] += sum(f".{pid}." not in name for name in temps)
            stats["temp_files_in_TMPDIR"] = len(list(shm.iterdir()))
            step = last + 1
    finally:
        proc.stdin.close()
        proc.kill()
        proc.wait()
        shutil.rmtree(shm, ignore_errors=True)
    return stats


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm (tmpfs) for TMPDIR")
def test_kill_9_during_saves_never_leaves_a_torn_checkpoint(tmp_path):
    folder = tmp_path / "checkpoints"
    stats = kill_loop("atomic", folder, kills=12)
    print(f"AtomicCheckpointIO kill loop: {stats}")
    assert stats["kills"] == 12
    assert stats["torn"] == 0 and stats["went_back"] == 0, stats  # always the old file or the new one, whole
    assert stats["temp_left_by_earlier_rounds"] == 0, stats  # each round's first save removed the last kill's temp
    assert stats["temp_files_in_TMPDIR"] == 0, stats  # nothing is staged outside the checkpoint folder
    cleanup_stale_temp_files(folder)
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt"]


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm (tmpfs) for TMPDIR")
def test_kill_9_counterfactual_lightning_checkpoint_io(tmp_path):
    """The same loop with Lightning's TorchCheckpointIO. Not asserted (which moments the kills hit is luck);
    it shows what the atomic IO prevents. Observed on a 2-core VM (12 kills each): seed 0 left a torn
    last.ckpt after 5 kills and 6 leaked temp files in TMPDIR; seed 1, 1 torn and 2 leaked (the atomic loop:
    0 torn, 0 leaked, with 9 of the 12 kills landing mid-save). ``pytest -s`` prints the figures."""
    stats = kill_loop("lightning", tmp_path / "checkpoints", kills=12)
    print(f"Lightning TorchCheckpointIO kill loop: {stats}")
    assert stats["kills"] == 12
