"""SIGTERM in multi-process training: every rank stops at the same batch, agreed every N batches.

Lightning starts every training batch of a multi-process run with a blocking broadcast of rank 0's
SIGTERM flag plus a host sync (Lightning issue 21487). Its signal handler also sends a broadcast of
its own, which only pairs with the other ranks' next per-batch broadcast, so checking less often
with that handler in place hangs every rank. The project's strategies replace both pieces:

* the handler only notes the signal (and, like Lightning's, forwards it to the ranks this process
  launched); during fit it does not stop this rank on its own;
* every ``every_n_batches`` training batches, the same batches on every rank, the ranks all-reduce
  (MAX) their notes; if any rank was signalled, all of them stop there together.

So a SIGTERM reaching any one rank stops the job within ``every_n_batches`` batches and no
collective is left unmatched. Outside fit (validate/test) the handler keeps Lightning's behaviour.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from lightning import Trainer
from lightning.pytorch.utilities.exceptions import SIGTERMException

from src.strategies import lightning_compat as compat
from src.utils.errors import ConfigError
from src.utils.pylogger import RankedLogger

log = RankedLogger(__name__)


def check_interval(every_n_batches: object) -> int:
    """The SIGTERM agreement interval, or a ConfigError naming the config key."""
    if isinstance(every_n_batches, bool) or not isinstance(every_n_batches, int) or every_n_batches < 1:
        raise ConfigError(
            f"sigterm_check_every_n_batches={every_n_batches!r} must be an integer >= 1 (1 = every batch)"
        )
    return every_n_batches


class SigtermSync:
    """This rank's SIGTERM note, agreed with the other ranks every ``every_n_batches`` batches.

    A picklable callable (ddp_spawn pickles the trainer): it replaces the loop's per-batch check.
    """

    def __init__(self, trainer: Trainer, every_n_batches: int) -> None:
        self.trainer, self.every_n_batches = trainer, every_n_batches
        self.signalled = False
        self.calls = 0

    def __call__(self) -> None:
        due = self.calls % self.every_n_batches == 0
        self.calls += 1
        if not due:
            return
        flag = torch.tensor([int(self.signalled)], device=self.trainer.strategy.root_device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            step = f"epoch {self.trainer.current_epoch}, global step {self.trainer.global_step}"
            log.info(f"SIGTERM: every rank stops here ({step})", rank=None)
            compat.mark_sigterm_received(self.trainer)
            with contextlib.suppress(Exception):
                dist.barrier()
            raise SIGTERMException()


class SigtermNote:
    """The SIGTERM handler: note the signal for :class:`SigtermSync` instead of stopping this rank alone."""

    def __init__(self, sync: SigtermSync) -> None:
        self.sync = sync

    def __call__(self, signum, frame) -> None:
        trainer = self.sync.trainer
        log.info(f"Received SIGTERM ({signum}); the job stops at the next check", rank=None)
        if not self.sync.signalled and trainer.strategy.launcher is not None:
            trainer.strategy.launcher.kill(signum)  # as Lightning: pass it on to the ranks this process started
        self.sync.signalled = True
        if trainer.state.fn != "fit":  # no per-batch check outside fit: Lightning's own stop
            compat.mark_sigterm_received(trainer)


def install_sigterm_agreement(trainer: Trainer, every_n_batches: int) -> bool:
    """Install the agreed SIGTERM stop on a multi-process ``trainer``; True if installed.

    Called from the strategy's ``setup``, before Lightning registers its signal handlers.
    Single-process trainers keep Lightning's own handling.
    """
    check_interval(every_n_batches)
    if trainer.world_size == 1:
        return False
    sync = SigtermSync(trainer, every_n_batches)
    compat.replace_sigterm_check(trainer, sync, SigtermNote(sync))
    return True
