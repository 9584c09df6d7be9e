"""Auto-resume is bit-exact: kill -9 a run at random points (in a step, in validation, during a checkpoint
save), re-run the same command each time, and the final weights equal those of an uninterrupted run.

Real processes, real SIGKILLs to the whole process group (every rank dies, as when a node is lost).
The MLP has dropout and the data is augmented, so a resume that lost the random state, the sampler's
order or the position in the epoch would end with other weights. The killed runs choose their callbacks
(none, or a hand-picked list) and the references keep the default ones: resume never depends on them.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from src.engine.run.status import FINISHED, read_status
from tests.helpers.training_runs import (
    differing_weights,
    finish,
    last_checkpoint,
    run_dirs,
    start,
    wait_for_checkpoint,
)

pytestmark = [pytest.mark.slow, pytest.mark.faults]

def kill_during_save(proc: subprocess.Popen, log_dir: Path, timeout: float = 60) -> bool:
    """SIGKILL the run the moment a checkpoint is being written (a temp file next to last.ckpt)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        for d in run_dirs(log_dir):
            ckpts = d / "checkpoints"
            if ckpts.is_dir() and any(p.name.endswith(".tmp") or ".ckpt." in p.name for p in ckpts.iterdir()):
                os.killpg(proc.pid, signal.SIGKILL)
                return True
        time.sleep(0.001)
    return False


def finished(log_dir: Path) -> bool:
    """Whether a run under ``log_dir`` has recorded ``finished``: a kill after that (the process was only
    ending) interrupted nothing, and a re-run of the command would start a new run."""
    return any(read_status(d) == FINISHED for d in run_dirs(log_dir))


def kill_and_resume(log_dir: Path, extra: list[str], kills: int, seed: int) -> tuple[Path, int]:
    """Run the same command until it finishes, SIGKILLing it ``kills`` times; returns (run dir, kills done)."""
    rng = random.Random(seed)
    done = 0
    for attempt in range(kills + 1):
        proc = start(log_dir, *extra)
        if attempt < kills and wait_for_checkpoint(proc, log_dir):
            if attempt == 1:
                killed = kill_during_save(proc, log_dir)
            else:
                time.sleep(rng.uniform(0.0, 1.2))
                killed = proc.poll() is None
                if killed:
                    os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
            if killed and not finished(log_dir):
                done += 1
                continue
            if killed:  # too late: status.yaml already said finished (a re-run would be a new run, by design)
                finish(proc)
                break
        assert finish(proc) == 0, proc.stderr_text[-3000:]
        break
    dirs = run_dirs(log_dir)
    assert len(dirs) == 1, f"every re-run must continue the same run dir, got {dirs}"
    return dirs[0], done


@pytest.mark.parametrize(("extra", "callbacks"), [
    ([], "callbacks=none"),
    (["trainer=ddp", "trainer.devices=2"], "callbacks=[model_checkpoint,rich_progress_bar]"),
    (["trainer=fsdp", "trainer.devices=2"], "callbacks=default"),
], ids=["1-process-no-callbacks", "ddp-2-ranks-picked-callbacks", "fsdp-2-ranks"])
def test_killed_runs_resume_bit_exact(tmp_path, extra, callbacks, reference_runs):
    ref_dir = reference_runs(*extra)

    # one process: three kills (random, mid-save, random); DDP and FSDP: two (random, mid-save), as their restarts
    # cost more; FSDP's last.ckpt is a folder of shards, swapped in whole
    run_dir, kills = kill_and_resume(tmp_path / "killed", [*extra, callbacks], kills=2 if extra else 3,
                                     seed=len(extra))
    assert kills >= 2, f"only {kills} kills landed while the run was training"
    assert "status: finished" in (run_dir / "status.yaml").read_text()
    differing = differing_weights(ref_dir, run_dir)
    assert not differing, f"after {kills} kills, weights differ from the uninterrupted run in {differing}"
    assert last_checkpoint(run_dir)["global_step"] == 180
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.endswith(".tmp")]
