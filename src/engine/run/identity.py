"""One launch, one run directory, agreed by all its ranks; a restart of the same launch finds it again.

:func:`choose_run_dir` is called once per launch, by :class:`src.engine.run.directory.RunDirectory` before Hydra
writes anything, unless the command names ``hydra.run.dir`` itself. In order:

1. **The launcher's job id.** A SkyPilot task (``SKYPILOT_TASK_ID``, kept across spot recoveries) or a
   SLURM job (``SLURM_JOB_ID`` plus array task and step, kept across requeues): every rank computes
   the same name, and a requeue or recovery lands in its own directory again, also after training
   finished: the task then finishes what is left (the test), or exits 0 saying the run is complete
   (:func:`src.engine.run.status.completed_task`). The name also carries a hash of the command's
   overrides, so two different trainings in one allocation get two dirs. (``auto_resume=false``: the
   first of ``name``, ``name_2`` ... that has neither finished nor saved a checkpoint: a requeue starts
   afresh beside the interrupted run.)
2. **torchrun.** The first rank to ask stores a fresh stamp in the elastic agent's store; the others,
   and the ranks of an elastic restart (``--max-restarts``), read it back. A second launch (new agent,
   same port or not) gets a new stamp.
3. **A plain command.** With ``auto_resume``, the newest run of this task started with the same
   overrides that did not finish and is not running (its lock is free) is taken over: re-running the
   command continues it from ``checkpoints/last.ckpt``, or starts it again in the same dir when it was
   killed before its first checkpoint. Overrides that only set the world size (``trainer.devices``,
   ``trainer.num_nodes``) do not count: the same command on another number of ranks continues the run
   (the data position is counted in global batches; the checkpoint's callbacks say what carried over). Otherwise a new directory named from the time, created
   exclusively (``_2``, ``_3`` ... for runs started in the same second). A run in this root whose
   status says ``running`` while its process is gone from this host is marked ``died`` on the way.

Each run dir also gets a random id, made once and kept in it (:func:`ensure_run_uid`; the ``${run_uid:}``
resolver only reads it): W&B and MLflow continue one run by it across resumes.

A directory taken over or created locally stays locked (``flock`` on ``.lock``) while this process
lives, so two identical commands never share one; the kernel drops the lock when the process dies,
even by SIGKILL. Children it forks do not hold it (DataLoader workers), except the ranks of a ``ddp_fork``
run, which write into the run dir.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

from src.engine.run.lock import try_lock
from src.engine.run.status import (
    ENDED,
    LAST_CHECKPOINT,
    RUNNING,
    STATUS_FILE,
    holds_checkpoints,
    mark_if_died,
    read_status,
)
from src.engine.runtime.launch_context import launch_context
from src.engine.utils.errors import ConfigError

LOCK_FILE = ".lock"
RUN_ID_FILE = ".run_id"
OVERRIDES_FILE = Path(".hydra") / "overrides.yaml"
_locks: dict[str, int] = {}  # run dir -> open fd holding its flock
_ranks_keep_lock = False  # forked children are ranks of this run (shared_with_forked_ranks)
_passed_over: Path | None = None  # the same command's unfinished run, skipped because a live process holds it


def release_run_dirs() -> None:
    """End of a Hydra run in this process: release the run dirs' locks (a later in-process run chooses anew)."""
    for fd in _locks.values():
        os.close(fd)
    _locks.clear()


@contextlib.contextmanager
def shared_with_forked_ranks() -> Iterator[None]:
    """While this runs, a forked child is a rank of this run (``ddp_fork``): it keeps the lock, since it
    writes into the run dir and could outlive a killed launcher; its own children drop it again."""
    global _ranks_keep_lock
    _ranks_keep_lock = True
    try:
        yield
    finally:
        _ranks_keep_lock = False


def _after_fork_in_child() -> None:
    """In a child the owner forked: close its copies of the lock fds, unless it is a rank of this run.

    A flock belongs to the open file, which a fork shares: a DataLoader worker that outlived its owner (killed
    alone, by the OOM killer, say; workers look for their parent every few seconds) would hold the lock on,
    and the re-run of the command would start a new run. Closing the child's copies leaves the lock the
    owner's alone (only an explicit unlock would drop it).
    """
    global _ranks_keep_lock
    if _ranks_keep_lock:
        _ranks_keep_lock = False  # this rank's own forks (its DataLoader workers) drop the lock
        return
    release_run_dirs()  # closes this child's copies only: the owner's lock stays


os.register_at_fork(after_in_child=_after_fork_in_child)


def choose_run_dir(root: Path, overrides: list[str], auto_resume: bool = True) -> Path:
    """The run directory (absolute) of this launch under ``root``; see the module docstring. Call it once."""
    global _passed_over
    _passed_over = None
    root = root.absolute()
    job_id = launch_context().job_id
    if job_id is not None:
        # every rank must reach the same answer without talking; a job's own earlier dir is kept, finished or not
        name = f"{job_id}_{hashlib.sha1(chr(10).join(overrides).encode()).hexdigest()[:8]}"
        names = [root / (name if n == 1 else f"{name}_{n}") for n in range(1, 10_000)]
        if auto_resume:  # the newest of name, name_2 ... (earlier versions made _2 after a finished run)
            return next((d for d in reversed(names[:_count_existing(names)])), names[0])
        # a fresh run: the first dir that neither ended nor holds checkpoints (all ranks find the same one)
        return next(d for d in names if read_status(d) not in ENDED and not holds_checkpoints(d))
    stamp = torchrun_stamp()
    if stamp is not None:
        return root / stamp
    if auto_resume:
        found = _unfinished_run(root, overrides)
        if found is not None:
            return found
    return _new_dir(root, dt.datetime.now().strftime("%Y-%m-%d_%H-%M-%S"))


def passed_over_note(chosen: Path) -> str | None:
    """Why the last :func:`choose_run_dir` started ``chosen`` afresh though the same command has an unfinished
    run (a live process holds it), or None. Said once, then cleared."""
    global _passed_over
    run, _passed_over = _passed_over, None
    if run is None:
        return None
    return (f"the same command's unfinished run {run} is held by a live process, so this launch starts a new "
            f"run in {chosen}; to continue that run instead, stop its process and run the command again")


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


def _count_existing(names: list[Path]) -> int:
    return next(n for n, d in enumerate(names) if not d.is_dir())


def _unfinished_run(root: Path, overrides: list[str]) -> Path | None:
    """The newest run of these overrides that did not finish and is not running (its lock is taken here).

    A run killed before its first checkpoint counts too, once its owner is gone: it starts again there.
    """
    if not root.is_dir():
        return None
    candidates = [d for d in root.iterdir() if d.is_dir() and (d / OVERRIDES_FILE).is_file()]
    held = None
    for run in sorted(candidates, key=_last_activity, reverse=True):
        mark_if_died(run)
        status = read_status(run)
        recorded = _recorded_overrides(run)
        if status in ENDED or recorded is None or without_world_size(recorded) != without_world_size(overrides):
            continue
        if status == RUNNING and not (run / LAST_CHECKPOINT).exists():
            continue  # its owner may live on another host (its lock would say so only on this one)
        if _lock(run):
            return run
        held = held or run  # the newest one a live process holds
    global _passed_over
    _passed_over = held  # no run continued: this launch starts a new one
    return None


WORLD_SIZE_KEYS = ("trainer.devices", "trainer.num_nodes")


def without_world_size(overrides: list[str]) -> list[str]:
    """``overrides`` less those that only choose how many ranks run (a run resumes on any number of them)."""
    return [o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in WORLD_SIZE_KEYS]


def _last_activity(run: Path) -> float:
    last = run / LAST_CHECKPOINT
    return max(p.stat().st_mtime for p in (run, last, run / STATUS_FILE) if p.exists())


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
    fd = try_lock(run / LOCK_FILE)
    if fd is None:
        return False
    _locks[str(run)] = fd
    return True


def ensure_run_uid(run_dir: str | os.PathLike) -> str:
    """The id of the run in ``run_dir``: random (16 hex digits), made by the first process to ask, kept in the dir.

    Every rank, and every later attempt of the run, reads the same one. The file appears whole or not at
    all (hard-linked from a temp file), so a rank never reads half an id.
    """
    path = Path(run_dir) / RUN_ID_FILE
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{RUN_ID_FILE}.{os.getpid()}.tmp")
        tmp.write_text(secrets.token_hex(8))
        try:
            os.link(tmp, path)
        except FileExistsError:  # another rank made it first: read theirs
            pass
        finally:
            tmp.unlink()
    return path.read_text().strip()


def read_run_uid(run_dir: str) -> str:
    """``${run_uid:<run dir>}``: the id :func:`ensure_run_uid` made when the job started (a resolver only reads)."""
    path = Path(run_dir) / RUN_ID_FILE
    if not path.is_file():
        raise ConfigError(f"{run_dir} has no run id ({RUN_ID_FILE}); fix: start the run with src/train.py, or call "
                          "src.engine.run.identity.ensure_run_uid(run_dir) before building its loggers")
    return path.read_text().strip()
