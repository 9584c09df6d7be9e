"""Every command in the code blocks of the README and of docs/*.md runs as written, kept short.

The commands are read from the files, so a command added there is tested here: training and evaluation
(`python src/train.py`, `src/eval.py`, torchrun, srun, `make`), the collectives room
(`python -m src.engine.collectives`, also under torchrun), the benchmarks (`python -m scripts.bench`) and the
test commands (`python -m pytest`). Each runs from the repository root, with arguments
appended that only make it short and keep its output in a temporary directory. A ``python src/<script>.py``
command is forked from a process that imported the entry points once, as the other tests' runs are
(:mod:`tests.helpers.entry`: the script runs as ``__main__`` with the command's argv; only Python's start-up and
the imports are shared); ``make train`` and the other commands run in a fresh shell. Only what this machine
cannot do is skipped, each with its reason (SKIP), and so is a command another test runs with its outputs
checked (RUN_ELSEWHERE); the targets that would run this suite itself or benchmark for minutes are dry-run
(DRY_RUN), and a pytest command collects its tests without running them.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from tests.helpers.config import ROOT
from tests.helpers.docs import assert_no_error_line, readme_commands
from tests.helpers.entry import SCRIPTS, run_entry

pytestmark = pytest.mark.slow

# Substring -> why this machine cannot run it. Keep this small: everything else must run.
SKIP = {
    "srun ": "needs a SLURM cluster; tests/test_ddp.py::test_slurm_environment_detected simulates one",
    "num_nodes=2": "needs a second machine (two nodes); tests/test_ddp.py simulates two nodes over loopback",
    "accelerator=gpu": "needs a CUDA GPU; the same strategy's CPU form runs in its own tests, GPU paths in tests -m gpu",
}
# Whole command -> the test that runs it, shortened, and checks its outputs (here it would only run again).
RUN_ELSEWHERE = {
    "python -m scripts.bench --suite throughput,startup --rounds 2":
        "tests/test_bench.py::test_bench_writes_table_json_and_plots runs it and checks its table, JSON and plots",
    "torchrun --standalone --nproc_per_node=2 src/train.py trainer=ddp trainer.devices=2":
        "tests/test_ddp.py::test_torchrun_one_node runs it and checks that both ranks chose one run directory",
    "torchrun --standalone --nproc_per_node=2 src/train.py trainer=fsdp trainer.devices=2":
        "tests/test_fsdp_cli.py::test_torchrun_one_node runs it and checks one run directory with both ranks' shards",
    "python src/train.py -m trainer=ddp trainer.devices=2 model.optimizer.lr=0.01,0.1":
        "tests/test_ddp.py::test_multirun_sweep_with_ddp runs it and checks each job's dir, checkpoint and ranks",
    "python src/train.py hparams_search=fashion_mnist_optuna trainer=ddp trainer.devices=2 hydra.sweeper.study_name=ddp":
        "tests/test_sweeps.py::test_optuna_search_with_ddp runs it and checks each trial's ranks and the study",
    "python src/train.py hparams_search=fashion_mnist_optuna hydra.sweeper.n_jobs=2 hydra.sweeper.study_name=two_at_a_time":
        "tests/test_sweeps.py::test_trials_run_in_parallel_processes runs it and checks that the trials overlapped",
    "python -m src.engine.collectives mode=check nproc=3":
        "tests/test_collectives.py::test_entry_point_check_mode runs it and checks its report: no failed check",
}
# Whole command -> why it is only dry-run (`make -n`: the target exists and expands).
DRY_RUN = {
    "make test": "runs this whole suite, this test included",
    "make test-oldest": "runs the fast tests again, on the oldest Lightning allowed; .ci/run runs it after the suite",
    "make bench": "benchmarks run for minutes by design; tests/test_bench.py runs their entry point briefly",
    "make bench-full": "benchmarks run for minutes by design (15-20 min)",
}
# Appended to every training/eval command: one epoch (two when resuming) of a few batches (of 32 samples for
# ResNet18), nothing else changed.
FEW_BATCHES = ["++trainer.limit_train_batches=1", "++trainer.limit_val_batches=1", "++trainer.limit_test_batches=1",
               "++trainer.num_sanity_val_steps=0"]
# Appended to `python -m src.engine.collectives`: the smallest sizes and fewest iterations of every mode.
FEW_MESSAGES = ["bench.sizes=[4KB]", "bench.warmup=1", "bench.iters=2", "ring.bench_sizes=[4KB]", "ring.warmup=1",
                "ring.iters=2", "sgd.epochs=1"]
# Appended to `python -m scripts.bench`: one round of two epochs of two steps, no per-sample or paired runs.
FEW_STEPS = ["--rounds", "1", "--epochs", "2", "--limit-train-batches", "2", "--accuracy-epochs", "1", "--workers", "''",
             "--no-paired", "--quiet-wait", "0", "--no-tty"]
SYNTHETIC_CIFAR10 = "data/synthetic_cifar10"  # where the README's `make synthetic-cifar10` writes


def _skip_reason(command: str) -> str | None:
    return next((reason for key, reason in SKIP.items() if key in command), None)


def _offline_data(command: str) -> list[str]:
    """The synthetic CIFAR-10 files for a command that would download CIFAR-10 (no network here)."""
    if re.search(r"\b(data|experiment)=cifar10", command) and "data.data_dir=" not in command:
        return [f"data.data_dir={SYNTHETIC_CIFAR10}", "data.verify_checksums=false"]
    return []


def _same_runs(commands: list[str]) -> dict[str, str]:
    """Command -> the earlier command that runs the same thing here once offline stand-ins are added (it runs once)."""
    def run(command: str) -> tuple[str, ...]:
        return tuple(sorted([*command.split(), *_offline_data(command)]))

    first: dict[tuple[str, ...], str] = {}
    for command in commands:
        first.setdefault(run(command), command)
    return {command: first[run(command)] for command in commands if first[run(command)] != command}


SAME_RUNS = _same_runs(readme_commands())


ENV = {"WANDB_SILENT": "true"}


@pytest.fixture(scope="module", autouse=True)
def _quiet_wandb():
    """W&B's messages off for every command (set once: the fork server's imports see one environment)."""
    with pytest.MonkeyPatch.context() as patch:
        for key, value in ENV.items():
            patch.setenv(key, value)
        yield


def _shell(command: str, timeout: int = 420) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _entry_script(command: str) -> str | None:
    """``train`` for a plain ``python src/train.py ...`` (no shell syntax), the scripts the fork server runs."""
    argv = shlex.split(command)
    plain = len(argv) > 1 and argv[0] == "python" and not set("$|&;<>`") & set(command)
    match = re.fullmatch(r"src/(\w+)\.py", argv[1]) if plain else None
    return match[1] if match and match[1] in SCRIPTS else None


def _make(command: str, args: list[str]) -> str:
    """``make X`` as written, minus the install step (done once by `make test`), with ARGS for the run."""
    target = command.removeprefix("make ")
    return f"make -o .make/installed {target}" + (f" ARGS={shlex.quote(' '.join(args))}" if args else "")


@pytest.fixture(scope="module")
def made_synthetic_cifar10() -> subprocess.CompletedProcess:
    """The README's `make synthetic-cifar10`, run once: the CIFAR-10 commands read its files (offline)."""
    return _shell(_make("make synthetic-cifar10", []))


PYTEST = "python -m pytest"
_COLLECT = """
import shlex, sys, pytest
for i, command in enumerate(sys.argv[1:]):
    rc = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *shlex.split(command)[3:]])
    print(f"\\n@@ {i} exit {int(rc)}", flush=True)
"""


@pytest.fixture(scope="module")
def pytest_collections() -> dict[str, tuple[int, str]]:
    """The README's pytest commands, collect-only, one after another in one process (one import of the suite):
    command -> (exit code, output). Running them would run (part of) this suite."""
    commands = [c for c in readme_commands() if c.startswith(PYTEST)]
    proc = subprocess.run(["python", "-c", _COLLECT, *commands], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    parts = re.split(r"^@@ (\d+) exit (-?\d+)$", proc.stdout, flags=re.M)  # [out0, i0, rc0, out1, i1, rc1, ...]
    assert len(parts) == 3 * len(commands) + 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    return {commands[int(i)]: (int(rc), out) for out, i, rc in zip(parts[0:-1:3], parts[1::3], parts[2::3], strict=True)}


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """A run directory of the default model, for the README's `logs/train/runs/<run>` placeholder."""
    logs = tmp_path_factory.mktemp("run")
    proc = run_entry("train", "trainer.max_epochs=1", *FEW_BATCHES, f"paths.log_dir={logs}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = (logs / "train" / "runs").iterdir()
    return run


def _run_overrides(command: str, logs: Path, request) -> list[str]:
    """A few batches, output under ``logs``, and offline stand-ins for data that would be downloaded."""
    args = [*FEW_BATCHES, f"paths.log_dir={logs}"]
    if "src/eval.py" not in command and "src/predict.py" not in command:  # the last value wins: a resumed run trains one epoch more
        args.insert(0, f"trainer.max_epochs={2 if 'ckpt_path=' in command else 1}")
    args += _offline_data(command)
    if "model=resnet18" in command:
        args.append("data.batch_size=32")  # ResNet18 on a CPU: a quarter of the batch keeps its few steps short
    if "hparams_search=fashion_mnist_optuna" in command:
        args.append("hydra.sweeper.n_trials=2")  # the last value wins: two trials show the search runs
    if "data=mnist" in command:
        args.append(f"data.data_dir={request.getfixturevalue('mnist_format_dir')}")  # Fashion-MNIST, MNIST's format
    return args


@pytest.mark.parametrize("command", readme_commands())
def test_readme_command_runs(command, tmp_path, request):
    if reason := _skip_reason(command) or RUN_ELSEWHERE.get(command):
        pytest.skip(reason)
    if same := SAME_RUNS.get(command):
        pytest.skip(f"here the same run as `{same}` (the synthetic CIFAR-10 files in place of the download)")
    if command in DRY_RUN:
        proc = _shell(f"make -n -o .make/installed {command.removeprefix('make ')}")
        assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr
        return
    if command == "make synthetic-cifar10":
        proc = request.getfixturevalue("made_synthetic_cifar10")
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "wrote SYNTHETIC CIFAR-10" in proc.stdout
        return
    if "cifar10" in command:
        assert request.getfixturevalue("made_synthetic_cifar10").returncode == 0
    if command.startswith(PYTEST):
        rc, out = request.getfixturevalue("pytest_collections")[command]
        assert rc == 0 and re.search(r"\d+ tests? collected", out), out[-2000:]
        return
    if "<run>" in command:
        command = command.replace("logs/train/runs/<run>", str(request.getfixturevalue("trained_run")))
    if "-m src.engine.collectives" in command:
        args = [*FEW_MESSAGES, f"paths.log_dir={tmp_path / 'logs'}"]
    elif command.startswith("python -m scripts.bench"):
        args = [*FEW_STEPS, "--out", str(tmp_path / "bench")]
    elif command.startswith("python src/export.py"):  # writes next to the checkpoint; nothing to shorten
        args = [f"hydra.run.dir={tmp_path / 'export'}"]
    else:
        args = _run_overrides(command, tmp_path / "logs", request)
    if script := _entry_script(command):
        proc = run_entry(script, *shlex.split(command)[2:], *shlex.split(" ".join(args)), timeout=420)
    else:
        proc = _shell(_make(command, args) if command.startswith("make ") else f"{command} {' '.join(args)}")
    assert proc.returncode == 0, f"{command}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert_no_error_line(proc.stderr)


def test_readme_commands_are_found():
    commands = readme_commands()
    assert "make train" in commands and "make synthetic-cifar10" in commands
    assert any(c.startswith("python src/eval.py") for c in commands)
    assert any(c.startswith("torchrun --standalone") for c in commands)
    for kind in ("python -m src.engine.collectives", "-m src.engine.collectives mode=check", "python -m scripts.bench",
                 "python -m pytest"):
        assert any(kind in c for c in commands), f"no {kind!r} command found in the README or docs/"
    for key in SKIP:
        assert any(key in c for c in commands), f"SKIP entry {key!r} matches no README command any more"
    for command in (*DRY_RUN, *RUN_ELSEWHERE):
        assert command in commands, f"DRY_RUN/RUN_ELSEWHERE entry {command!r} is no longer in the README or docs/"
