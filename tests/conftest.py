"""Shared fixtures: composed train/eval configs and small data on disk."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

# One torch thread per test process (and, through the environment, per process a test starts), unless the caller
# chose a count. The suite runs two test files at a time, and most start ranks of their own: with torch's default
# of one thread per core they oversubscribe the cores, and OpenMP's spin-waiting burns the difference. Set before
# torch is imported, so that this process's thread pool is sized by it too.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

from tests.helpers.config import ROOT, compose_cfg  # noqa: E402

os.environ.setdefault("PROJECT_ROOT", str(ROOT))


@pytest.fixture(autouse=True)
def _no_launched_process_outlives_its_test():
    """A test that fails while a run it launched still goes leaves nothing running for the next one."""
    yield
    from tests.helpers.training_runs import end_launched

    end_launched()


@pytest.fixture
def cfg_train(tmp_path):
    """Default training config (Fashion-MNIST MLP), CPU, a few batches, output in tmp."""
    return compose_cfg("train", [], tmp_path)


@pytest.fixture
def make_cfg(tmp_path):
    """``make_cfg("train", ["model=resnet18"])`` -> a composed, tiny config writing into tmp_path."""

    def _make(config_name: str = "train", overrides=(), subdir: str = "", tiny: bool = True):
        out = tmp_path / subdir if subdir else tmp_path
        out.mkdir(parents=True, exist_ok=True)
        return compose_cfg(config_name, list(overrides), out, tiny=tiny)

    return _make


@pytest.fixture(scope="session")
def reference_runs(tmp_path_factory):
    """``reference_runs(*extra)``: the run dir of one uninterrupted ``TRAIN`` run per ``extra``, shared by the
    fault tests (they only read its final weights), so each reference trains once per test run: in a folder
    that pytest-xdist's workers share, the first worker to need it trains it while the others wait."""
    from tests.helpers.training_runs import reference_run

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the run's folder; each worker's basetemp is a folder in it
    done: dict[tuple[str, ...], Path] = {}

    def get(*extra: str) -> Path:
        if extra not in done:
            folder = shared / f"reference-{hashlib.sha1(chr(0).join(extra).encode()).hexdigest()[:12]}"
            with open(f"{folder}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
                made = folder / "run_dir"
                if not made.is_file():
                    folder.mkdir(exist_ok=True)
                    made.write_text(str(reference_run(folder, *extra)))
                done[extra] = Path(made.read_text())
        return done[extra]

    return get


@pytest.fixture(scope="session")
def synthetic_cifar10(tmp_path_factory) -> Path:
    """SYNTHETIC CIFAR-10 files in the real on-disk format, written by the project's script."""
    out = tmp_path_factory.mktemp("cifar")
    subprocess.run(
        [sys.executable, str(ROOT / "scripts/make_synthetic_cifar10.py"), "--out", str(out),
         "--per-batch", "60", "--test", "100"],
        check=True, capture_output=True,
    )
    return out


@pytest.fixture(scope="session")
def mnist_format_dir(tmp_path_factory) -> Path:
    """An MNIST data_dir (MNIST/raw/*-ubyte) built from the offline Fashion-MNIST files: same IDX format."""
    from src.data.mnist_datamodule import MNISTDataModule

    fashion = MNISTDataModule(dataset="fashion_mnist", data_dir=str(ROOT / "data"))
    fashion.prepare_data()
    out = tmp_path_factory.mktemp("mnist")
    raw = out / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for path in fashion._raw_files():
        shutil.copy(path, raw / path.name)
    return out


# The longest files first: `make test` runs two files at a time, and a long file started last would leave the
# other worker idle at the end. A stable sort: the order within and after these files is pytest's own.
LONGEST_FIRST = ("test_readme_commands.py", "test_ps.py", "test_bench.py", "test_preemption.py", "test_ps_faults.py",
                 "test_auto_resume.py", "test_fsdp.py", "test_owned_step.py", "test_ddp.py", "test_bad_input.py",
                 "test_world_sizes.py", "test_run_identity.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
