"""One launch, one run directory, agreed by all its ranks; a restart of the same launch finds it again.

``hydra.run.dir`` is resolved through :func:`run_dir_name`. In order:

1. **The launcher's job id.** A SkyPilot task (``SKYPILOT_TASK_ID``, kept across spot recoveries) or a
   SLURM job (``SLURM_JOB_ID`` plus array task and step, kept across requeues): every rank computes
   the same name, and a requeue or recovery lands in its own directory again. The name also carries
   a hash of the command's overrides, so two different trainings in one allocation get two dirs.
2. **torchrun.** The first rank to ask stores a fresh stamp in the elastic agent's store; the others,
   and the ranks of an elastic restart (``--max-restarts``), read it back. A second launch (new agent,
   same port or not) gets a new stamp.
3. **A plain command.** With ``auto_resume``, the newest run of this task started with the same
   overrides that did not finish, holds ``checkpoints/last.ckpt`` and is not running (its lock is
   free) is taken over: re-running the command continues it. Otherwise a new directory named from
   the time, created exclusively (``_2``, ``_3`` ... for runs started in the same second).

A directory taken over or created locally stays locked (``flock`` on ``.lock``) while this process
lives, so two identical commands never share one; the kernel drops the lock when the process dies,
even by SIGKILL.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

from src.runtime.launch_context import launch_context
from src.utils.run_status import ENDED, read_status

LOCK_FILE = ".lock"
OVERRIDES_FILE = Path(".hydra") / "overrides.yaml"
_chosen: dict[tuple, str] = {}  # hydra.run.dir is resolved several times per run: answer alike each time
_locks: dict[str, int] = {}  # run dir -> open fd holding its flock


def run_dir_name(runs_root: str, overrides: Sequence[str] = (), auto_resume: bool = True) -> str:
    """The run directory (absolute path) of this launch; see the module docstring."""
    key = (str(runs_root), tuple(overrides), bool(auto_resume))
    if key not in _chosen:
        _chosen[key] = str(_choose(Path(runs_root).absolute(), list(overrides), auto_resume))
    return _chosen[key]


def forget_run_dir() -> None:
    """End of a Hydra run in this process: release the locks and the remembered choice."""
    _chosen.clear()
    for fd in _locks.values():
        os.close(fd)
    _locks.clear()


def _choose(root: Path, overrides: list[str], auto_resume: bool) -> Path:
    job_id = launch_context().job_id
    if job_id is not None:
        # every rank must reach the same answer without talking: the first of name, name_2, ... not finished
        name = f"{job_id}_{hashlib.sha1(chr(10).join(overrides).encode()).hexdigest()[:8]}"
        return next(root / (name if n == 1 else f"{name}_{n}") for n in range(1, 10_000)
                    if read_status(root / (name if n == 1 else f"{name}_{n}")) not in ENDED)
    stamp = torchrun_stamp()
    if stamp is not None:
        return root / stamp
    if auto_resume:
        found = _unfinished_run(root, overrides)
        if found is not None:
            return found
    return _new_dir(root, dt.datetime.now().strftime("%Y-%m-%d_%H-%M-%S"))


def torchrun_stamp(timeout_s: float = 60.0) -> str | None:
    """Under torchrun, the stamp the first rank put in the agent's store (None outside torchrun)."""
    ctx = launch_context()
    if ctx.torchrun_run_id is None:
        return None
    if not ctx.torchrun_agent_store:  # no agent store to agree through
        return "torchrun_" + ctx.torchrun_run_id
    from torch.distributed import TCPStore

    store = TCPStore(ctx.master_addr, int(ctx.master_port), is_master=False, timeout=dt.timedelta(seconds=timeout_s))
    mine = dt.datetime.now().strftime("%Y-%m-%d_%H-%M-%S") + f"_torchrun_{os.getpid()}"
    return store.compare_set("lightning_hydra_template/run_dir", "", mine).decode()


def _unfinished_run(root: Path, overrides: list[str]) -> Path | None:
    """The newest resumable run of these overrides that is not running (its lock is taken here)."""
    if not root.is_dir():
        return None
    candidates = [d for d in root.iterdir() if (d / "checkpoints" / "last.ckpt").exists()]  # file or fsdp folder
    for run in sorted(candidates, key=lambda d: (d / "checkpoints" / "last.ckpt").stat().st_mtime, reverse=True):
        if read_status(run) in ENDED or _recorded_overrides(run) != overrides:
            continue
        if _lock(run):
            return run
    return None


def _recorded_overrides(run: Path) -> list[str] | None:
    from omegaconf import OmegaConf

    path = run / OVERRIDES_FILE
    return list(OmegaConf.load(path)) if path.is_file() else None


def _new_dir(root: Path, name: str) -> Path:
    """Create ``root/name`` (or ``name_2``, ``name_3`` ...) exclusively, and lock it."""
    root.mkdir(parents=True, exist_ok=True)
    for n in range(1, 10_000):
        path = root / (name if n == 1 else f"{name}_{n}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        _lock(path)
        return path
    raise RuntimeError(f"no free run directory name under {root}")


def _lock(run: Path) -> bool:
    """Take ``run``'s lock for the life of this process; False if another process holds it."""
    fd = os.open(run / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False
    _locks[str(run)] = fd
    return True
