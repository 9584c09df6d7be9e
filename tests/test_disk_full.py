"""A checkpoint that does not fit on its disk: one line naming the file, the bytes needed and the bytes free,
the last good checkpoint kept, no temp file left, and every rank of a DDP job ends.

The process test runs the real command on a real 12 MB tmpfs, mounted in a user namespace (``unshare -rm``,
no root needed); where the kernel refuses user namespaces it is skipped and the unit test below, with a
writer that raises ENOSPC, still runs.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from src.engine.checkpointing import io as checkpoint_io
from src.engine.checkpointing.io import AtomicCheckpointIO, DiskFullError
from tests.helpers.config import ROOT
from tests.helpers.training_runs import finish, launch

pytestmark = pytest.mark.faults

ERROR = re.compile(r"^error: no space left to save checkpoint (\S+): it needs (\d+) bytes .* and (\d+) bytes .* are "
                   r"free there; the last good checkpoint is kept; fix: ", re.M)


@pytest.mark.fast
def test_a_writer_out_of_space_raises_one_line_and_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    dest = tmp_path / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint({"step": 1, "w": torch.ones(1000)}, dest)
    before = dest.read_bytes()
    real_fdopen = os.fdopen

    class FullDisk:
        """The temp file's writer: the disk fills after 64 KiB."""

        def __init__(self, fd: int, mode: str) -> None:
            self.file, self.written = real_fdopen(fd, mode), 0

        def write(self, data) -> int:
            self.written += memoryview(data).nbytes
            if self.written > 1 << 16:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return self.file.write(data)

        def __getattr__(self, name):
            return getattr(self.file, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            self.file.close()

    monkeypatch.setattr(checkpoint_io.os, "fdopen", FullDisk)
    checkpoint = {"step": 2, "w": torch.zeros(1 << 18)}
    with pytest.raises(DiskFullError) as raised:
        io.save_checkpoint(checkpoint, dest)
    message = str(raised.value)
    assert "\n" not in message and str(dest) in message
    monkeypatch.undo()
    AtomicCheckpointIO().save_checkpoint(checkpoint, tmp_path / "fits.ckpt")  # the same save where it fits
    assert raised.value.needed == (tmp_path / "fits.ckpt").stat().st_size > 1 << 18
    assert f"it needs {raised.value.needed} bytes" in message and f"{raised.value.free} bytes" in message
    assert dest.read_bytes() == before  # the last good checkpoint stays
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fits.ckpt", "last.ckpt"]  # no temp file


def _user_namespaces_work() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
                           capture_output=True)
    return probe.returncode == 0


# The default run with its resume checkpoint every 2 steps: last.ckpt (6.2 MiB, MLP + Adam) fits on 12 MB, the
# second save next to it does not.
SMALL = ["+trainer.limit_train_batches=5", "+trainer.limit_val_batches=2", "last_ckpt_every_n_train_steps=2",
         "extras.print_config=false"]


@pytest.mark.slow
@pytest.mark.skipif(not _user_namespaces_work(), reason="no unprivileged user namespaces here to mount a small tmpfs")
@pytest.mark.parametrize("extra", [[], ["trainer=ddp", "trainer.devices=2"]], ids=["1-process", "ddp-2-ranks"])
def test_a_full_disk_stops_every_rank_with_one_line_and_keeps_the_last_checkpoint(tmp_path, extra):
    mount, after = tmp_path / "small", tmp_path / "after"
    mount.mkdir()
    command = " ".join([sys.executable, str(ROOT / "src" / "train.py"), *SMALL, *extra, f"paths.log_dir={mount}"])
    # the mount lives as long as its namespace: what the run left there is copied out once rank 0 has exited
    proc = launch(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=12m tmpfs {mount} && "
                   f"{{ {command}; code=$?; cp -a {mount}/train {after}; exit $code; }}"])
    ranks: dict[int, psutil.Process] = {}
    while proc.poll() is None:
        with contextlib.suppress(psutil.Error):
            ranks.update({p.pid: p for p in psutil.Process(proc.pid).children(recursive=True)})
        time.sleep(0.05)
    code = finish(proc)
    _, alive = psutil.wait_procs(list(ranks.values()), timeout=15)  # every rank ends with the one that failed
    assert not alive, f"ranks still running 15 s after rank 0 exited: {alive}"

    assert code == 2, proc.stderr_text[-3000:]
    assert "Traceback" not in proc.stderr_text, proc.stderr_text[-3000:]
    errors = ERROR.findall(proc.stderr_text)
    assert len(errors) == 1, proc.stderr_text[-3000:]
    path, needed, free = Path(errors[0][0]), int(errors[0][1]), int(errors[0][2])
    assert path.name == "last.ckpt" and needed > free

    (run_dir,) = (after / "runs").iterdir()
    checkpoints = run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["last.ckpt"]  # no temp file left
    kept = torch.load(checkpoints / "last.ckpt", weights_only=True)
    assert kept["global_step"] == 2  # the last good save, whole
    status = (run_dir / "status.yaml").read_text()
    assert "status: failed" in status and "DiskFullError at epoch 0, global step 4" in status
