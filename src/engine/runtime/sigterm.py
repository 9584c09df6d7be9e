"""Stop signals (SIGTERM, SIGUSR1): every rank stops at the same batch, saves a resumable checkpoint there,
and the job exits non-zero (or, on SLURM after SIGUSR1, requeues itself).

Lightning starts every training batch of a multi-process run with a blocking broadcast of rank 0's
SIGTERM flag plus a host sync (Lightning issue 21487). Its signal handler also sends a broadcast of
its own, which only pairs with the other ranks' next per-batch broadcast, so checking less often
with that handler in place hangs every rank. And when it stops, nothing is saved and the process
exits 0, so a preempted job looks successful. The project's strategies replace these pieces:

* the handler only notes the signal (and, like Lightning's, forwards it to the ranks this process
  launched); during fit it does not stop this rank on its own;
* every ``every_n_batches`` training batches, the same batches on every rank, the ranks all-reduce
  (MAX) their notes; if any rank was signalled, all of them stop together. The reduction is read at
  the next check, so on a GPU it runs in the device's queue and the host never waits for it;
* at that batch every rank joins :func:`stop_for_preemption`: ``last.ckpt`` is written (weights,
  optimizer, loop and data position, random state), then each rank exits with 128 + the signal
  number (143 for SIGTERM, 138 for SIGUSR1). Re-running the command resumes from there.

SIGUSR1 is what ``#SBATCH --signal=SIGUSR1@90`` sends before the time limit: after the checkpoint,
global rank 0 asks SLURM to requeue the job (``scontrol requeue``), which Lightning's own handler
would do after saving mid-step from inside the signal handler. A job started by submitit (the
``hydra/launcher=slurm`` sweeps) gets USR2 instead: submitit's own handler would requeue at once,
mid-step, with nothing saved. Its handler is kept and called after the checkpoint, so submitit still
pickles the job for the requeue and counts its time-outs. A requeued job ends with ``SystemExit``
(as submitit's handler does), so neither Hydra nor submitit records a result for it: the requeued
job, in the same job dir, resumes from ``last.ckpt`` and gives the result. Where ``scontrol`` is
missing (a pyxis/enroot container), one line says the job was not requeued; the checkpoint is
saved anyway. Outside fit (validate/test) the handler keeps Lightning's behaviour. One-process
runs get the same stop, checked after every batch, from :class:`src.engine.checkpointing.stop_signals.StopSignals`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from lightning import Trainer
from lightning.pytorch.utilities.exceptions import SIGTERMException

from src.engine.checkpointing.last_checkpoint import (
    LastCheckpoint,
    last_checkpoint_path,
    run_position,
    saves_mid_epoch,
)
from src.engine.runtime.launch_context import launch_context
from src.engine.utils import lightning_compat as compat
from src.engine.utils.errors import ConfigError
from src.engine.utils.pylogger import RankedLogger

log = RankedLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# The launcher's own handler of its preemption signal (submitit's USR2), called after the checkpoint.
# Kept here, not on the picklable SigtermSync: it holds the job's pickled submission.
_launcher_handlers: dict[int, Callable[[int, Any], Any]] = {}


_early_stop = 0  # a stop signal that reached a spawned or forked rank before its stop handlers were installed


def note_early_stop(signum: int, frame: Any) -> None:
    """The stop-signal handler of a spawned or forked rank until :func:`install_stop_handlers` takes over: the
    signal is kept for it (Python's default would end the rank with nothing saved)."""
    global _early_stop
    _early_stop = max(_early_stop, signum)


def hold_stop_signals() -> None:
    """At the start of a spawned or forked rank (:class:`src.engine.strategies.launchers.SpawnedRank`): keep a stop signal
    for the handlers its strategy installs, instead of its parent's handler (fork) or Python's default (spawn)."""
    if threading.current_thread() is threading.main_thread():
        for signum in STOP_SIGNALS:
            signal.signal(signum, note_early_stop)


class Preempted(SIGTERMException):
    """Every rank stopped on a signal after saving ``last.ckpt``; exits with ``128 + signal number``.

    ``requeued``: the job was put back in the queue; it exits with SystemExit, leaving no result behind.
    """

    preempted = True

    def __init__(self, signum: int, requeued: bool = False) -> None:
        super().__init__(128 + signum)
        self.signal_name = signal.Signals(signum).name
        self.requeued = requeued

    def __str__(self) -> str:
        return f"{self.signal_name}, last.ckpt saved; exit code {self.code}"


def check_interval(every_n_batches: object) -> int:
    """The SIGTERM agreement interval, or a ConfigError naming the config key (checked where the strategy is built)."""
    if isinstance(every_n_batches, bool) or not isinstance(every_n_batches, int) or every_n_batches < 1:
        raise ConfigError(f"trainer.strategy.sigterm_check_every_n_batches={every_n_batches!r} must be an integer "
                          ">= 1; fix: set it to 1 (every batch) or more")
    return every_n_batches


def stop_for_preemption(trainer: Trainer, signum: int) -> NoReturn:
    """On every rank at the agreed batch: save ``last.ckpt``, requeue on SLURM after SIGUSR1, raise :class:`Preempted`."""
    name = signal.Signals(signum).name
    where = run_position(trainer)
    path = last_checkpoint_path(trainer)
    if saves_mid_epoch(trainer) or trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
        trainer.save_checkpoint(path, weights_only=False)  # every rank takes part, global rank 0 writes
        saved = f"saved {path}"
    else:
        saved = f"kept {path} of the last epoch's end (the training loader cannot resume mid-epoch)"
    log.info(f"{name}: every rank stopped at {where}; {saved}. Re-run the same command to resume.", rank=None)
    requeued = False
    if signum in _launcher_handlers:
        requeued = hand_over_to_launcher(signum)
    elif signum == signal.SIGUSR1 and launch_context().slurm_job:
        requeued = requeue_slurm_job() if trainer.is_global_zero else True
    compat.mark_sigterm_received(trainer)
    raise Preempted(signum, requeued)


def late_stop_signal(trainer: Trainer) -> int:
    """A stop signal that came after the fit's last check (the last interval's batches, the last validation):
    agreed once more at the end of fit, on every rank, so the job still stops before it tests (0: none).

    One process, or the agreed stop of :func:`stop_for_preemption` (ps stops each role its own way).
    """
    sync = compat.per_batch_check_of(trainer)
    if not isinstance(sync, SigtermSync) or (trainer.world_size > 1 and sync.on_signal is not stop_for_preemption):
        return 0
    return sync.final_agreement()


def late_stop(trainer: Trainer) -> Callable[[], NoReturn] | None:
    """What :class:`LastCheckpoint` runs at the end of fit when :func:`late_stop_signal` found a signal (None: none)."""
    late = late_stop_signal(trainer)
    return (lambda: stop_for_preemption(trainer, late)) if late else None


def stop_exit_code(err: SIGTERMException) -> int:
    """The exit code of a stop: a :class:`Preempted`'s own, or 143 for Lightning's own stop outside fit, which
    carries none (it would exit 0, and a stopped job must not look successful)."""
    return err.code if isinstance(err.code, int) else 128 + signal.SIGTERM


@contextlib.contextmanager
def passed_on_to_spawned_ranks(launcher: Any) -> Iterator[None]:
    """While this process waits for the ranks it spawned (``ddp_spawn``), a stop signal sent to it alone
    (``kill <pid>``, a scheduler signalling the process it started) goes on to every rank, which save and
    stop at the agreed batch. Python's default would end this process at once and leave the ranks training
    on, orphaned, with the run still recorded as running.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    parent = os.getpid()

    def pass_on(signum: int, frame: Any) -> None:
        if os.getpid() != parent:  # a forked rank, before SpawnedRank holds its stop signals
            note_early_stop(signum, frame)
            return
        log.info(f"Received {signal.Signals(signum).name}: passed on to the ranks, which save and stop at the next "
                 "check", rank=None)
        launcher.kill(signum)

    previous = {signum: signal.signal(signum, pass_on) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def stop_of_spawned_ranks(err: BaseException, trainer: Trainer | None) -> SIGTERMException | None:
    """The stop that a spawned rank's end reports (torch's ``ProcessExitedException``), to raise again in the
    parent so that its run status and exit code say so; None for any other failure.

    Exit 128 + a stop signal in fit: the ranks saved ``last.ckpt`` at the agreed batch. Outside fit (Lightning's
    own stop), or a rank ended by the signal itself (it came before the rank's handlers): nothing was saved.
    """
    code = getattr(err, "exit_code", None)
    if not isinstance(code, int):
        return None
    if code - 128 in STOP_SIGNALS and trainer is not None and trainer.state.fn == "fit":
        return Preempted(code - 128)
    if code - 128 in STOP_SIGNALS or -code in STOP_SIGNALS:
        return SIGTERMException()
    return None


def requeue_slurm_job() -> bool:
    """``scontrol requeue`` this SLURM job (array task); the requeued job resumes from ``last.ckpt``. True if done."""
    job = launch_context().slurm_job
    try:
        result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        log.warning(no_scontrol(job))
        return False
    except (OSError, subprocess.TimeoutExpired) as err:
        log.warning(f"could not requeue SLURM job {job}: {err}; last.ckpt is saved: resubmit the job to resume")
        return False
    if result.returncode == 0:
        log.info(f"requeued SLURM job {job}")
        return True
    log.warning(f"scontrol requeue {job} failed ({result.returncode}): {result.stderr.strip()}; last.ckpt is saved: "
                "resubmit the job to resume")
    return False


def no_scontrol(job: str | None) -> str:
    return (f"SLURM job {job} not requeued: there is no scontrol here (a container without SLURM's tools, e.g. "
            f"pyxis/enroot); last.ckpt is saved: resubmit the job, or run `scontrol requeue {job}` on the host")


def hand_over_to_launcher(signum: int) -> bool:
    """After the checkpoint, let the launcher's own handler (submitit's) requeue the job; True if it did.

    submitit's handler pickles the job for the requeue and runs ``scontrol requeue`` on global rank 0,
    then raises SystemExit; on the other ranks it does nothing.
    """
    try:
        _launcher_handlers[signum](signum, None)
    except SystemExit:
        return True
    except FileNotFoundError:  # its `scontrol requeue`
        log.warning(no_scontrol(launch_context().slurm_job))
        return False
    except subprocess.CalledProcessError as err:
        log.warning(f"submitit could not requeue the job: {err}; last.ckpt is saved: resubmit the job to resume")
        return False
    return not launch_context().is_global_zero  # another rank: global rank 0 requeues


class SigtermSync:
    """This rank's stop-signal note, agreed with the other ranks every ``every_n_batches`` batches.

    A picklable callable (ddp_spawn pickles the trainer): it replaces the loop's per-batch check. Once the
    ranks agree on a signal, ``on_signal(trainer, signum)`` runs (by default :func:`stop_for_preemption`;
    ps, whose ranks share no process group, gives each role its own).
    """

    def __init__(self, trainer: Trainer, every_n_batches: int,
                 on_signal: Callable[[Trainer, int], None] | None = None) -> None:
        self.trainer, self.every_n_batches = trainer, every_n_batches
        self.on_signal = on_signal or stop_for_preemption
        self.signum = 0  # the signal this rank received (0: none)
        self.calls = 0
        self._pending: tuple[torch.Tensor, torch.cuda.Event | None] | None = None  # the last check's reduction

    @property
    def signalled(self) -> bool:
        return self.signum != 0

    def __call__(self) -> None:
        due = self.calls % self.every_n_batches == 0
        self.calls += 1
        if not due:
            return
        multi = self.trainer.world_size > 1 and dist.is_available() and dist.is_initialized()
        signum = self._agree() if multi else self.signum
        if signum:
            self.on_signal(self.trainer, signum)

    def _agree(self) -> int:
        """The largest note of any rank at the previous check, and this check's notes sent to be reduced.

        Every rank reads the same round, so all stop at the same batch. The reduction of a round is read a
        check later: on a GPU it and its copy to pinned host memory run in the device's queue meanwhile,
        so the host never waits for the device in the middle of training.
        """
        agreed = 0
        if self._pending is not None:
            host, copied = self._pending
            if copied is not None:
                copied.synchronize()  # recorded a whole interval ago: done by now, so this does not wait
            agreed = int(host[0])
        device = self.trainer.strategy.root_device
        flag = torch.full((1,), self.signum, dtype=torch.int32, device=device)  # a fill: no host-to-device copy
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # SIGTERM (15) wins over SIGUSR1 (10)
        if device.type == "cuda":
            host = torch.empty(1, dtype=torch.int32, pin_memory=True).copy_(flag, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
            self._pending = (host, copied)
        else:
            self._pending = (flag, None)
        return agreed

    def final_agreement(self) -> int:
        """At the end of fit, on every rank: the largest stop signal any rank noted since the last check, or
        that the last check agreed on and nobody read yet (0: none)."""
        if not (self.trainer.world_size > 1 and dist.is_available() and dist.is_initialized()):
            return self.signum
        agreed = self._agree()  # the last check's round; this one's notes sent
        host, copied = self._pending
        if copied is not None:
            copied.synchronize()
        self._pending = None
        return max(agreed, int(host[0]))

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_pending": None}  # CUDA events do not pickle; nothing is in flight at a launch


class SigtermNote:
    """The stop-signal handler: note the signal for :class:`SigtermSync` instead of stopping this rank alone."""

    def __init__(self, sync: SigtermSync) -> None:
        self.sync = sync

    def __call__(self, signum, frame) -> None:
        trainer = self.sync.trainer
        log.info(f"Received {signal.Signals(signum).name}; the job saves and stops at the next check", rank=None)
        if not self.sync.signalled and trainer.strategy.launcher is not None:
            trainer.strategy.launcher.kill(signum)  # as Lightning: pass it on to the ranks this process started
        self.sync.signum = max(self.sync.signum, signum)
        if trainer.state.fn != "fit":  # no per-batch check outside fit: Lightning's own stop
            compat.mark_sigterm_received(trainer)


def install_sigterm_agreement(trainer: Trainer, every_n_batches: int) -> SigtermSync | None:
    """Install the agreed stop on a multi-process ``trainer``; the :class:`SigtermSync` if installed.

    Called from the strategy's ``setup``, before Lightning registers its signal handlers.
    Single-process trainers are handled by :class:`src.engine.checkpointing.stop_signals.StopSignals`.
    """
    if trainer.world_size == 1:
        return None
    return install_stop_handlers(trainer, every_n_batches)


def install_stop_handlers(trainer: Trainer, every_n_batches: int,
                          on_signal: Callable[[Trainer, int], None] | None = None) -> SigtermSync:
    """Handlers for SIGTERM (through Lightning's connector) and SIGUSR1; the loop's check is the returned sync."""
    global _early_stop
    sync = SigtermSync(trainer, every_n_batches, on_signal)
    note = SigtermNote(sync)
    compat.replace_sigterm_check(trainer, sync, note)
    for callback in trainer.callbacks:  # the end of fit agrees once more on a signal after the last check
        if isinstance(callback, LastCheckpoint):
            callback.late_stop = late_stop
    if _early_stop:  # received while this rank started: agreed at the first check
        log.info(f"Received {signal.Signals(_early_stop).name} while starting; the job saves and stops at the next "
                 "check", rank=None)
        sync.signum, _early_stop = max(sync.signum, _early_stop), 0
    if threading.current_thread() is threading.main_thread():
        # Lightning registers SIGUSR1 only for SLURM auto-requeue, and not over a handler already there
        with contextlib.suppress(ValueError, OSError):
            signal.signal(signal.SIGUSR1, note)
        preempt = launch_context().preempt_signal  # submitit's USR2: save first, then submitit requeues
        signum = getattr(signal, f"SIG{preempt}", None) if preempt else None
        if signum is not None:
            previous = signal.getsignal(signum)
            if callable(previous) and not isinstance(previous, SigtermNote):
                _launcher_handlers[signum] = previous
            signal.signal(signum, note)
    return sync
