"""The commands each contender runs, and the environment they share.

Every contender gets the same model, data, global batch, optimizer, epochs, step limit and torch
thread count (``OMP_NUM_THREADS``/``MKL_NUM_THREADS``; each run records ``torch.get_num_threads()``).
The project runs as a user runs it, ``python src/train.py`` with the default config (rich progress
bar, CSV logger, checkpointing, epoch summary, metric plot, printed config tree); the only overrides
are the epoch count, an optional per-epoch step limit, the run directory, the bench-only
timeline callback, and the accelerator and precision, which every contender gets explicitly (the
config's ``accelerator: auto`` would put the project on a GPU next to a plain loop on the CPU).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ACCELERATORS = ("cpu", "gpu")  # Lightning's names; gpu = CUDA
PRECISIONS = ("32-true", "bf16-mixed")
# workload -> (default global batch, the project's overrides). resnet18 trains on SYNTHETIC CIFAR-10 files
# (`make synthetic-cifar10`): speed only, their accuracy means nothing.
SYNTHETIC_CIFAR10 = ROOT / "data" / "synthetic_cifar10"
WORKLOADS = {
    "mlp": (128, ()),
    "resnet18": (256, ("data=cifar10", "model=resnet18", f"data.data_dir={SYNTHETIC_CIFAR10}",
                       "data.verify_checksums=false")),
}
_CLUSTER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
                 "GROUP_RANK", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_PROCID")


@dataclass(frozen=True)
class Work:
    """What every contender of one comparison does."""

    epochs: int
    limit_train_batches: int = 0  # steps per epoch; 0 = whole epochs
    batch_size: int | None = None  # global; None = the project config's (128)
    accelerator: str = "cpu"  # cpu | gpu (Lightning's names)
    precision: str = "32-true"  # 32-true | bf16-mixed
    workload: str = "mlp"  # a key of WORKLOADS

    @property
    def global_batch(self) -> int:
        return self.batch_size or WORKLOADS[self.workload][0]


def env(threads: int) -> dict[str, str]:
    """The environment of every contender: fixed thread count, a terminal type, no inherited rank variables."""
    out = {k: v for k, v in os.environ.items() if k not in _CLUSTER_VARS}
    out.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TERM=out.get("TERM") or "xterm-256color",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    if out["TERM"] == "dumb":
        out["TERM"] = "xterm-256color"
    return out


def project(work: Work, prefix: Path, run_dir: Path, *overrides: str) -> list[str]:
    """``python src/train.py`` with its defaults, plus the bench timeline callback."""
    cmd = [sys.executable, "src/train.py", *WORKLOADS[work.workload][1], f"trainer.max_epochs={work.epochs}",
           f"hydra.run.dir={run_dir}", "+callbacks.bench_timer._target_=scripts.bench.step_timer.StepTimer",
           f"+callbacks.bench_timer.prefix={prefix}", *overrides,
           f"trainer.accelerator={work.accelerator}", f"trainer.precision={work.precision}"]
    if work.batch_size or work.workload != "mlp":
        cmd.append(f"data.batch_size={work.global_batch}")
    if work.limit_train_batches:
        cmd.append(f"++trainer.limit_train_batches={work.limit_train_batches}")
    return cmd


def project_ddp(work: Work, prefix: Path, run_dir: Path, nproc: int, group: str = "ddp") -> list[str]:
    """``trainer=<group>`` (ddp, ddp_fork) with ``nproc`` ranks."""
    return project(work, prefix, run_dir, f"trainer={group}", f"trainer.devices={nproc}")


def plain(work: Work, prefix: Path, data: str = "in_memory", workers: int = 0, run_dir: Path | None = None) -> list[str]:
    """The plain PyTorch loop (``data="per_sample"``: torchvision's per-sample pipeline); checkpoints in ``run_dir``."""
    return [sys.executable, "-m", "scripts.bench.plain_loop", "--epochs", str(work.epochs),
            "--batch-size", str(work.global_batch), "--limit-train-batches", str(work.limit_train_batches),
            "--data", data, "--workers", str(workers), "--timeline", str(prefix), *checkpoint_option(prefix, run_dir),
            *device_options(work)]


def bare_lightning(work: Work, prefix: Path, paired: bool = False, run_dir: Path | None = None) -> list[str]:
    """The plain loop's work in a minimal LightningModule under ``Trainer(barebones=True)``."""
    return [sys.executable, "-m", "scripts.bench.bare_lightning", "--epochs", str(work.epochs),
            "--batch-size", str(work.global_batch), "--limit-train-batches", str(work.limit_train_batches),
            "--timeline", str(prefix), *(["--paired", str(paired_path(prefix))] if paired else []),
            *checkpoint_option(prefix, run_dir), *device_options(work)]


def checkpoint_option(prefix: Path, run_dir: Path | None) -> list[str]:
    """Where a plain script saves its per-epoch checkpoint: ``<run_dir>/last.pt`` (default next to the timeline)."""
    return ["--checkpoint", str(Path(run_dir) / "last.pt" if run_dir else Path(f"{prefix}.last.pt"))]


def device_options(work: Work) -> list[str]:
    """The plain scripts' ``--accelerator``, ``--precision`` and ``--workload``."""
    return ["--accelerator", work.accelerator, "--precision", work.precision, "--workload", work.workload]


def project_paired(work: Work, prefix: Path, run_dir: Path) -> list[str]:
    """``python src/train.py`` with its defaults, plus an interleaved plain step after each training step."""
    return project(work, prefix, run_dir, "+callbacks.bench_paired._target_=scripts.bench.paired_step.PairedPlainStep",
                   f"+callbacks.bench_paired.out={paired_path(prefix)}")


def paired_path(prefix: Path) -> Path:
    """Where a paired run (``scripts.bench.paired_step``) writes its medians."""
    return Path(f"{prefix}.paired.json")


def plain_ddp(work: Work, prefix: Path, nproc: int, run_dir: Path | None = None) -> list[str]:
    """The plain torch DDP script: CPU ranks on gloo only (its ``work`` must be on the CPU, in fp32)."""
    if (work.accelerator, work.precision) != ("cpu", "32-true"):
        raise ValueError(f"plain_ddp runs on the CPU in 32-true only, not {work.accelerator}/{work.precision}")
    return [sys.executable, "-m", "scripts.bench.plain_ddp", "--nproc", str(nproc), "--epochs", str(work.epochs),
            "--batch-size", str(work.global_batch), "--limit-train-batches", str(work.limit_train_batches),
            "--threads", "0", "--timeline", str(prefix), *checkpoint_option(prefix, run_dir)]
