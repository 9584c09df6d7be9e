"""An Optuna search over Hydra jobs: pruned trials, trials in parallel processes, resumable searches.

``hydra-optuna-sweeper`` pins Optuna 2.x and sees only each trial's final value, so it never prunes. Here
the sweeper asks the study for a trial, launches it as one Hydra job (through whatever launcher is set:
in-process, submitit), and tells the study its result; the job's rank 0 reports its validation metric
after every epoch and stops early when the pruner says so (``src/engine/callbacks/optuna_pruning.py``).

* **One trial, one job, one dir.** Trial ``n`` is job ``n`` in ``<sweep dir>/n`` and trains with
  ``seed + n`` (``seed_per_trial``), both kept for the life of the study.
* **Cross-validated.** With ``cv_folds=K`` a trial is K jobs, fold ``i`` of ``data.n_folds=K`` each (job
  ``n*K + i``), and its value is the mean of theirs. Fold 0 runs first and alone reports to the pruner.
* **Parallel.** With ``n_jobs > 1`` the sweep starts that many worker processes, each this same command
  with ``hydra.sweeper.worker=i``: each runs trials one after another against the shared study, as Optuna's
  own parallel optimisation does. A worker gets its share of the GPUs (``CUDA_VISIBLE_DEVICES``) when its
  jobs run in-process, and its own sampler seed. A lock file makes ask-and-count atomic across workers, so
  exactly ``n_trials`` trials run.
* **Resumable.** The study lives in a file (or database) in the sweep dir. Re-running the same command
  continues it: finished trials are skipped, and a trial left ``RUNNING`` by a killed search runs again in
  its own dir, from its ``last.ckpt``. While a search runs, its dir is locked (``flock``).
* **One study, many searches.** Several searches (other sweep dirs, other machines) may share one storage.
  A running trial names its owner, the process that runs it (``search_owner``: host, pid, start time and a
  heartbeat every ``HEARTBEAT_S``). Another search takes it over only when that owner is known to be gone:
  its process ended on this host, or its heartbeat is older than ``hydra.sweeper.owner_timeout_s``. Taking
  a trial over and asking for a new one happen under one lock beside the study's file (the journal or the
  SQLite file; the sweep dir for a database server), so no two searches take the same trial.

Hydra builds its sweeper only from a module under ``hydra_plugins`` (``hydra.core.plugins``), so
``hydra_plugins/optuna_search`` holds the ``Sweeper`` Hydra sees; it hands the sweep to :class:`OptunaSearch`.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import statistics
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import optuna
import psutil
from hydra.core.utils import JobStatus
from hydra.plugins.launcher import Launcher
from omegaconf import DictConfig
from optuna.trial import FrozenTrial, TrialState

from src.engine.run.lock import try_lock
from src.engine.run.status import owner_gone
from src.engine.runtime.hydra_launch import entry_command
from src.engine.search.study import open_study, search_space, study_file, trial_by_number, trial_overrides
from src.engine.utils.errors import ConfigError

SEARCH_LOCK, ASK_LOCK = ".search.lock", ".ask.lock"  # in the sweep dir; the ask lock beside the study's file
OWNER = "search_owner"  # a running trial's user attribute: the process that runs it, and its last heartbeat
HEARTBEAT_S = 30.0
# Hydra overrides a worker gets from the sweep itself, not from the command that started the sweep
_SET_FOR_WORKERS = ("hydra.mode", "hydra.sweep.dir", "hydra.sweeper.worker")
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)


class OptunaSearch:
    """One process's part of a search: the whole search, or one worker's trials (``worker``)."""

    def __init__(self, config: DictConfig, launcher: Launcher) -> None:
        """``config``: the sweep's config (its ``hydra.sweeper`` node is this search's settings)."""
        sweeper = config.hydra.sweeper
        if sweeper.direction not in ("maximize", "minimize"):
            raise ConfigError(f"hydra.sweeper.direction={sweeper.direction!r}; fix: maximize or minimize "
                              "(optimized_mode=max or min)")
        if sweeper.n_trials < 1 or sweeper.n_jobs < 1:
            raise ConfigError(f"hydra.sweeper.n_trials={sweeper.n_trials}, n_jobs={sweeper.n_jobs}; "
                              "fix: both at least 1")
        folds = sweeper.get("cv_folds")
        if folds is not None and (isinstance(folds, bool) or not isinstance(folds, int) or folds < 2):
            raise ConfigError(f"hydra.sweeper.cv_folds={folds!r} must be an integer >= 2; fix: set it, or null for "
                              "one validation split per trial")
        self.config, self.launcher, self.sweeper = config, launcher, sweeper
        self.n_trials, self.n_jobs, self.worker = sweeper.n_trials, sweeper.n_jobs, sweeper.get("worker")
        self.folds = folds

    def sweep(self, arguments: list[str]) -> None:
        sweeper = self.sweeper
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)  # the journal file goes there before any job runs
        fixed, space = search_space(sweeper.params, arguments)
        self.ask_lock = _ask_lock_path(sweeper, sweep_dir)
        if self.worker is not None:  # a worker of a parallel search: its share of the trials
            offset = self.worker + self.n_jobs * len(open_study(sweeper).trials)  # unique per worker and restart
            self._run_trials(open_study(sweeper, sampler_seed_offset=offset), fixed, space)
            return
        lock = _hold_search_lock(sweep_dir)  # released by the kernel when this process and its workers end
        study = open_study(sweeper, sampler_seed_offset=0)
        self._check_same_command(study, sweep_dir)
        stale = [t.number for t in self._left_behind(study)]
        done = len(study.get_trials(deepcopy=False, states=FINISHED))
        print(f"[search] study {sweeper.study_name} in {sweep_dir}: {done} of {self.n_trials} trials done"
              + (f", {len(stale)} to resume ({', '.join(map(str, stale))})" if stale else "")
              + f"; {self.n_jobs} at a time", flush=True)
        if self.n_jobs == 1:
            self._run_trials(study, fixed, space)
        else:
            self._run_workers(lock)

    # -- trials ----------------------------------------------------------------------------------------
    def _run_trials(self, study: optuna.Study, fixed: list[str], space: dict) -> None:
        """Take over trials whose search is gone, and ask for new ones until ``n_trials`` have started."""
        parent = os.getppid()
        while self.worker is None or os.getppid() == parent:  # a worker whose sweep is gone starts nothing new
            with _locked(self.ask_lock):
                left = self._left_behind(study)
                if left:
                    number, params = left[0].number, left[0].params
                else:
                    started = study.get_trials(deepcopy=False, states=(*FINISHED, TrialState.RUNNING))
                    if len(started) >= self.n_trials:
                        return
                    asked = study.ask(space)
                    number, params = asked.number, asked.params
                trial = trial_by_number(self.sweeper, study, number)
                trial.set_user_attr(OWNER, _owner_record())  # under the lock: no other search takes it now
            self._run_trial(study, trial, params, fixed)

    def _left_behind(self, study: optuna.Study) -> list[FrozenTrial]:
        """The running trials whose owner is known to be gone (see the module docstring)."""
        timeout = float(self.sweeper.get("owner_timeout_s") or 120)
        return [t for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)) if _owner_is_gone(t, timeout)]

    def _run_trial(self, study: optuna.Study, trial: optuna.trial.Trial, params: dict, fixed: list[str]) -> None:
        """Trial ``number`` as job ``number``; its result told to the study (a pruned trial was told already)."""
        number = trial.number
        seed = self.config.get("seed")
        seed = seed + number if self.sweeper.seed_per_trial and seed is not None else None
        with _heartbeat(trial):
            jobs = self._launch(study, number, trial_overrides(fixed, params, seed))
        failed = next((job for job in jobs if job.status != JobStatus.COMPLETED), None)
        told = study.get_trials(deepcopy=False)[number]  # a study's trials are listed in the order of their numbers
        if told.state == TrialState.RUNNING:  # else pruned: the job's rank 0 told the study so
            if self.folds:
                trial.set_user_attr("cv_values", [job.return_value for job in jobs])
            # a value of NaN or None: Optuna records the trial as FAIL and says why
            told = study.tell(number, None if failed else _mean([job.return_value for job in jobs]),
                              state=TrialState.FAIL if failed else None)
        value = "" if told.value is None else f", value {told.value:.6g}"  # pruned: its last reported value
        over = f" (mean of {len(jobs)} folds)" if self.folds and told.state == TrialState.COMPLETE else ""
        print(f"[search] trial {number}: {told.state.name}{value}{over}", flush=True)
        if failed:
            _ = failed.return_value  # raises the job's error, as Hydra's own sweepers do

    def _launch(self, study: optuna.Study, number: int, overrides: list[str]) -> list:
        """Trial ``number`` as job ``number``; with ``cv_folds=K``, as jobs ``number*K + i``, fold ``i`` each.

        Fold 0 runs first and alone reports to the pruner: a trial pruned there runs no other fold.
        """
        if not self.folds:
            return list(self.launcher.launch([overrides], initial_job_idx=number))
        folds = [[*overrides, f"data.n_folds={self.folds}", f"data.fold={i}"] for i in range(self.folds)]
        jobs = list(self.launcher.launch(folds[:1], initial_job_idx=number * self.folds))
        running = study.get_trials(deepcopy=False)[number].state == TrialState.RUNNING
        if jobs[0].status == JobStatus.COMPLETED and running:
            jobs += self.launcher.launch(folds[1:], initial_job_idx=number * self.folds + 1)
        return jobs

    def _check_same_command(self, study: optuna.Study, sweep_dir: Path) -> None:
        """A study continues only under the command that started it: its results must stay comparable."""
        command = list(self.config.hydra.overrides.task)
        started_with = study.user_attrs.get("overrides")
        if started_with is None:
            study.set_user_attr("overrides", command)
        elif started_with != command:
            raise ConfigError(
                f"the search in {sweep_dir} was started with other overrides ({' '.join(started_with)}); fix: run "
                "it with those to continue it, or start another search with hydra.sweeper.study_name=<new name>")

    # -- parallel workers ------------------------------------------------------------------------------
    def _run_workers(self, lock: int) -> None:
        """Start ``n_jobs`` workers (this command, ``hydra.sweeper.worker=i``) and wait for them all."""
        cwd = self.config.hydra.runtime.cwd
        workers = [subprocess.Popen(self._worker_command(i), cwd=cwd, pass_fds=(lock,),
                                    env={**os.environ, **self._worker_devices(i)}) for i in range(self.n_jobs)]
        try:
            codes = [w.wait() for w in workers]
        finally:  # interrupted: the workers' trials stay RUNNING and are resumed by the next run
            for w in workers:
                if w.poll() is None:
                    w.terminate()
                    w.wait()
        failed = next((code for code in codes if code), 0)
        if failed:
            raise SystemExit(failed)

    def _worker_command(self, worker: int) -> list[str]:
        hc = self.config.hydra
        inherited = [o for o in hc.overrides.hydra if not o.lstrip("~+").startswith(_SET_FOR_WORKERS)]
        return [*entry_command(hc), *inherited, *hc.overrides.task, f'hydra.sweep.dir="{hc.sweep.dir}"',
                "hydra.mode=MULTIRUN", f"hydra.sweeper.worker={worker}"]

    def _worker_devices(self, worker: int) -> dict[str, str]:
        """``CUDA_VISIBLE_DEVICES`` for a worker whose jobs run in its own process: its share of the GPUs.

        That is Hydra's ``basic`` launcher; jobs that a launcher sends elsewhere (submitit) get their GPUs there.
        """
        if self.config.hydra.runtime.choices.get("hydra/launcher") != "basic":
            return {}
        import torch

        count = torch.cuda.device_count()
        if count == 0:
            return {}
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = (visible.split(",") if visible else [str(i) for i in range(count)])[:count]
        per_worker = max(1, len(ids) // self.n_jobs)  # fewer GPUs than workers: they share, round robin
        mine = (ids[(worker * per_worker + i) % len(ids)] for i in range(per_worker))
        return {"CUDA_VISIBLE_DEVICES": ",".join(mine)}


def _mean(values: list) -> float | None:
    """The mean of the jobs' values; None (the trial fails) when one is not a number."""
    if not values or any(isinstance(v, bool) or not isinstance(v, int | float) for v in values):
        return None
    return statistics.fmean(values)


def _owner_record() -> dict:
    me = psutil.Process()
    return {"host": socket.gethostname(), "pid": me.pid, "started": me.create_time(), "beat": time.time()}


def _owner_is_gone(trial: FrozenTrial, timeout_s: float) -> bool:
    """True when the process running ``trial`` ended on this host, or its heartbeat is ``timeout_s`` old.

    A trial with no owner was asked by a search that died before it could name itself (or by an older
    version of this search, which named none).
    """
    owner = trial.user_attrs.get(OWNER)
    if not isinstance(owner, dict):
        return True
    return owner_gone(owner) or time.time() - float(owner.get("beat", 0)) > timeout_s


@contextlib.contextmanager
def _heartbeat(trial: optuna.trial.Trial) -> Iterator[None]:
    """While the trial's job runs, refresh its owner's heartbeat every ``HEARTBEAT_S``."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(HEARTBEAT_S):
            with contextlib.suppress(Exception):  # a finished trial takes no attributes; the next beat retries
                trial.set_user_attr(OWNER, _owner_record())

    thread = threading.Thread(target=beat, name="search-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _ask_lock_path(sweeper: DictConfig, sweep_dir: Path) -> Path:
    """The lock every search of this study takes to ask or take over a trial: beside the study's file, or
    in the sweep dir when the study is on a database server (one search per study there)."""
    path = study_file(sweeper)
    return path.with_name(path.name + ASK_LOCK) if path is not None else sweep_dir / ASK_LOCK


def _hold_search_lock(sweep_dir: Path) -> int:
    """Lock the search's dir for as long as this process (and the workers it passes the lock to) lives."""
    fd = try_lock(sweep_dir / SEARCH_LOCK)
    if fd is None:
        raise ConfigError(f"another search is running in {sweep_dir} (it holds {SEARCH_LOCK}); fix: wait for it "
                          "to end, or start this one elsewhere: hydra.sweeper.study_name=... (or hydra.sweep.dir=...)")
    return fd


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)

