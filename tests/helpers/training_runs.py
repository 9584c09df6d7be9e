"""Start ``src/train.py`` as a user's shell would, watch its run directory, read its final weights."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from tests.helpers.config import ROOT
from tests.helpers.entry import ForkedRun, forked

# A short deterministic MLP run on real Fashion-MNIST: dropout and augmentation draw random numbers, so a
# resume that lost the random state, the shuffle or the position in the epoch ends with other weights.
TRAIN = ["model=mlp", "data=fashion_mnist", "data.augment=true", "logger=csv", "trainer.max_epochs=3",
         "+trainer.limit_train_batches=60", "+trainer.limit_val_batches=5", "test=false",
         "last_ckpt_every_n_train_steps=3", "++callbacks.metric_plot=null"]


def start(log_dir: Path, *extra: str, env: dict | None = None) -> subprocess.Popen:
    """``python src/train.py ...`` in its own session, so a kill reaches every rank it starts."""
    return launch([sys.executable, str(ROOT / "src" / "train.py"), *TRAIN, *extra, f"paths.log_dir={log_dir}"], env)


LAUNCHED: list[subprocess.Popen] = []  # ended by tests/conftest.py after each test, pass or fail


def launch(command: list[str], env: dict | None = None) -> subprocess.Popen | ForkedRun:
    """Start ``command`` in its own session; stderr goes to a file (a pipe nobody reads yet would fill and block).
    ``python src/<script>.py ...`` without an environment of its own is forked from the imports made once
    (:func:`tests.helpers.entry.forked`)."""
    proc = None if env is not None else forked(command)
    if proc is not None:
        LAUNCHED.append(proc)
        return proc
    err = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed by finish(), after the process ends
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err, text=True,
                            start_new_session=True, env=env)
    proc.stderr_file = err
    LAUNCHED.append(proc)
    return proc


def end_launched() -> None:
    """SIGKILL the session of every process :func:`launch` started that still runs (its ranks with it)."""
    while LAUNCHED:
        proc = LAUNCHED.pop()
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: the pgid is its pid
            proc.wait(timeout=60)


def run_dirs(log_dir: Path) -> list[Path]:
    root = log_dir / "train" / "runs"
    return sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


def wait_for_checkpoint(proc: subprocess.Popen, log_dir: Path, timeout: float = 120) -> bool:
    """Until this attempt has written a last.ckpt (True: there is something to resume) or ended (False)."""
    started = time.time()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        for d in run_dirs(log_dir):
            last = d / "checkpoints" / "last.ckpt"  # a file, or trainer=fsdp's folder
            if last.exists() and last.stat().st_mtime > started:
                return True
        time.sleep(0.01)
    return False


def last_checkpoint(run_dir: Path) -> dict:
    """``checkpoints/last.ckpt`` of a run, a file or a sharded folder, read whole."""
    from src.engine.checkpointing.io import load_checkpoint_file

    return load_checkpoint_file(run_dir / "checkpoints" / "last.ckpt")


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return last_checkpoint(run_dir)["state_dict"]


def finish(proc: subprocess.Popen, timeout: float = 600) -> int:
    """Wait for ``proc``; its exit code (stderr is kept on ``proc.stderr_text`` for assertion messages)."""
    proc.wait(timeout=timeout)
    proc.stderr_file.seek(0)
    proc.stderr_text = proc.stderr_file.read()
    proc.stderr_file.close()
    return proc.returncode


def reference_run(log_dir: Path, *extra: str) -> Path:
    """An uninterrupted run of the same command: its run directory."""
    proc = start(log_dir, *extra)
    assert finish(proc) == 0, proc.stderr_text[-3000:]
    (run_dir,) = run_dirs(log_dir)
    return run_dir


def differing_weights(expected_run: Path, run: Path) -> list[str]:
    """Names of the parameters whose final values differ (bit for bit) between two runs."""
    expected, got = final_weights(expected_run), final_weights(run)
    assert expected.keys() == got.keys()
    return [k for k in expected if not torch.equal(expected[k], got[k])]
