"""Every rank's random state and running metrics in each checkpoint, so a resumed run continues bit-exact and
logs what an uninterrupted run logs.

Lightning 2 restores weights, optimizer, loop counters and (for stateful loaders) the data position,
but no random state: after a restart, dropout and augmentation draw other numbers than the
uninterrupted run would have, and the weights drift apart. No Lightning or torch callback saves it
per rank, hence this one.
"""

from __future__ import annotations

import random
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from torch.utils.data import DataLoader
from torchmetrics.utilities.data import dim_zero_max, dim_zero_mean, dim_zero_min

from src.engine.checkpointing.loader_position import keeps_position, train_loaders
from src.engine.strategies.global_batch import data_replica
from src.engine.utils import lightning_compat as compat
from src.engine.utils.hooks import RandomStatePerRank, ResumableMetrics
from src.engine.utils.pylogger import RankedLogger

log = RankedLogger(__name__)

CHECKPOINT_KEY = "random_state_per_rank"


def capture_random_state(trainer: L.Trainer) -> dict[str, Any]:
    """This process's random streams, as tensors and plain lists (loadable with ``weights_only=True``)."""
    np_state = np.random.get_state()
    version, py_state, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *map(float, np_state[2:])],
        "python": [version, list(py_state), gauss],
    }
    device = trainer.strategy.root_device
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    datamodule = trainer.datamodule
    if datamodule is not None and hasattr(datamodule, "generator_states"):
        state["datamodule"] = datamodule.generator_states()
    return state


def restore_random_state(trainer: L.Trainer, state: dict[str, Any]) -> None:
    """Put back what :func:`capture_random_state` took."""
    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), cached))
    version, py_state, gauss = state["python"]
    random.setstate((version, tuple(py_state), gauss))
    device = trainer.strategy.root_device
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
    datamodule = trainer.datamodule
    if "datamodule" in state and datamodule is not None and hasattr(datamodule, "load_generator_states"):
        datamodule.load_generator_states(state["datamodule"])


class ResumeRandomState(Callback):
    """Save each rank's random streams in every checkpoint; restore this rank's when training resumes.

    Saving gathers the states to every rank (all ranks build the checkpoint, rank 0 writes it). They
    are restored at ``on_train_start``: after the resumed run's set-up (sanity check, loader start-up)
    has drawn whatever it draws, and before the first batch, which is where the saved run stood.
    A strategy whose runs cannot replay bit-exact (``random_state_per_rank = False``: ps, whose updates
    depend on when pushes arrive) gets neither the gather nor the restore.
    """

    def __init__(self) -> None:
        self._pending: dict[str, Any] | None = None

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        if not replays_per_rank(trainer):
            return
        checkpoint[CHECKPOINT_KEY] = gather_per_rank(trainer, capture_random_state(trainer))

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        states = checkpoint.get(CHECKPOINT_KEY)
        if not replays_per_rank(trainer):
            return
        if not states:
            log.warning("The checkpoint holds no random state: the resumed run will not match an uninterrupted one")
        elif len(states) != trainer.world_size:
            log.warning(f"Resuming a checkpoint of {len(states)} rank(s) on {trainer.world_size}: the weights, the "
                        "optimizer state and the position in the data carry over; each rank's random streams "
                        "(dropout, augmentation) start afresh, so the run will not match an uninterrupted one bit "
                        "for bit")
        else:
            self._pending = states[trainer.global_rank]
            if loads_after_fit_start(trainer):  # on_fit_start has run: put them back now, before any loader draws
                restore_random_state(trainer, self._pending)

    @property
    def restores_random_state(self) -> bool:
        """This fit puts back each rank's saved random streams (a module need not seed its own then)."""
        return self._pending is not None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Restored early too, for a plain ``DataLoader``: it draws its shuffle and worker seeds from the global
        stream when its iterator is made, before ``on_train_start`` in a resumed fit and at the epoch's start in
        an uninterrupted one (nothing draws between that restore and that iterator). A strategy that loads the
        checkpoint after set-up (fsdp) calls ``on_load_checkpoint`` after this hook: they are restored there."""
        if self._pending is not None:
            restore_random_state(trainer, self._pending)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._pending is not None:
            if not draws_seeds_at_epoch_start(trainer):
                restore_random_state(trainer, self._pending)
            self._pending = None


def loads_after_fit_start(trainer: L.Trainer) -> bool:
    """Whether this fit reads its checkpoint after ``on_fit_start``: Lightning restores after the strategy's set-up
    for one whose ``restore_checkpoint_after_setup`` is true (fsdp, ModelParallel, DeepSpeed), and that set-up
    precedes ``on_fit_start``."""
    return trainer.state.fn == TrainerFn.FITTING and trainer.strategy.restore_checkpoint_after_setup


def draws_seeds_at_epoch_start(trainer: L.Trainer) -> bool:
    """Whether this fit, resumed at an epoch's end, has a training loader that drew its seeds from the global
    stream when its iterator was made (a ``DataLoader`` without a generator or a position of its own)."""
    done = trainer.fit_loop.epoch_loop.batch_progress.current.completed
    if 0 < done < trainer.num_training_batches:  # resumed mid-epoch: only loaders that keep their position do
        return False
    return any(isinstance(loader, DataLoader) and loader.generator is None and not keeps_position(loader)
               for loader in train_loaders(trainer))


def replays_per_rank(trainer: L.Trainer) -> bool:
    """False for a strategy that says its runs cannot replay bit-exact; Lightning's own strategies can."""
    strategy = trainer.strategy
    return strategy.random_state_per_rank if isinstance(strategy, RandomStatePerRank) else True


def gather_per_rank(trainer: L.Trainer, mine: Any) -> list[Any]:
    """Every rank's ``mine``, indexed by global rank, on every rank (all ranks build the checkpoint)."""
    if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
        states: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(states, mine)
        return states
    return [mine]


METRICS_KEY = "running_metrics_per_rank"


class ResumeMetricState(Callback):
    """Save the running metrics in every checkpoint, once per data-parallel replica; put them back on resume.

    An epoch's training loss and accuracy accumulate over the epoch's batches (torchmetrics states, per
    rank), and a best-so-far tracker over epochs. Neither is in a checkpoint: a run resumed mid-epoch
    would log that epoch's mean over the batches after the resume only. The module names the metrics
    that carry over (``resumable_metrics(mid_epoch)``, :class:`src.engine.steps.step_module.StepModule`); their
    states are gathered as :class:`ResumeRandomState` gathers random states, kept once per data-parallel
    replica (every stage of a pipeline holds its replica's copy), and restored at ``on_train_start``. The
    epoch's own metrics are kept only by a save inside a training epoch, and restored only when the resume
    goes on with that epoch. On another number of replicas, each state is reduced over the saved replicas as
    the metric syncs it, and shared out so that the synced value is the same: a state synced by max, min or
    mean (the best-so-far tracker) goes whole to every replica; one synced by sum (the epoch's sums and
    counts) goes to replica 0, and the other replicas start empty.
    """

    def __init__(self) -> None:
        self._pending: dict[str, Any] | None = None
        self._saved_replicas: list[dict[str, Any]] | None = None  # every saved replica's states, when their number changed

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        # at the epoch's last validation (a user's epoch-end save) the epoch's training metrics are complete: a
        # resume from there starts the next epoch and must not carry them into it. A mid-epoch validation's
        # save (last.ckpt waits for it) resumes within the epoch: they carry over.
        epoch_end_validation = trainer.validating and trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        metrics = _resumable(pl_module, mid_epoch=not (epoch_end_validation or trainer.sanity_checking))
        if not metrics:
            return
        mine = {name: {k: _to_cpu(v) for k, v in m.metric_state.items()} for name, m in metrics.items()}
        per_replica: dict[int, Any] = {}
        for replica, states in gather_per_rank(trainer, (data_replica(trainer.strategy)[1], mine)):
            per_replica.setdefault(replica, states)  # a pipeline's stages hold one copy of their replica's states
        checkpoint[METRICS_KEY] = [per_replica[r] for r in sorted(per_replica)]

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        states = checkpoint.get(METRICS_KEY)
        replicas, replica = data_replica(trainer.strategy)
        if states and len(states) == replicas:
            self._pending = states[replica]
        elif states:
            self._saved_replicas = states

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._pending is None and self._saved_replicas is None:
            return
        # Lightning ends an epoch resumed from its last batch without more batches: nothing more accumulates there
        loop = trainer.fit_loop
        mid_epoch = loop.restarted_mid_epoch and not loop.epoch_loop.batch_progress.is_last_batch
        for name, metric in _resumable(pl_module, mid_epoch).items():
            if self._pending is not None:
                _set_state(metric, self._pending.get(name, {}))
            else:
                _take_from_other_replicas(metric, [s.get(name, {}) for s in self._saved_replicas],
                                            data_replica(trainer.strategy)[1])
        self._pending = self._saved_replicas = None


def _set_state(metric: Any, state: dict[str, Any]) -> None:
    for key, value in state.items():
        setattr(metric, key, _to_device(value, metric.device))


_EVERY_REPLICA_HOLDS_WHOLE = (dim_zero_max, dim_zero_min, dim_zero_mean)  # a reduction of equal values gives that value


def _take_from_other_replicas(metric: Any, saved: list[dict[str, Any]], replica: int) -> None:
    """This replica's share of ``saved`` (one state per replica of another number); see :class:`ResumeMetricState`.

    Each state is reduced over the saved replicas as the metric syncs it (sum, max, concatenation...),
    whatever values they hold. A state synced by max, min or mean goes whole to every replica; any other (a
    sum, a list) to replica 0 alone, so the new replicas count it once.
    """
    for key, reduce in compat.state_reductions(metric).items():
        values = [state[key] for state in saved if key in state]
        if not values or (replica != 0 and reduce not in _EVERY_REPLICA_HOLDS_WHOLE):
            continue  # this replica starts empty
        if isinstance(values[0], list):
            whole = [item for value in values for item in value]
        else:
            whole = values[0] if reduce is None else reduce(torch.stack(values))
        setattr(metric, key, _to_device(whole, metric.device))


def _resumable(pl_module: L.LightningModule, mid_epoch: bool) -> dict[str, Any]:
    return pl_module.resumable_metrics(mid_epoch) if isinstance(pl_module, ResumableMetrics) else {}


def _to_cpu(value: Any) -> Any:
    return [v.detach().cpu() for v in value] if isinstance(value, list) else value.detach().cpu()


def _to_device(value: Any, device: torch.device) -> Any:
    return [v.to(device) for v in value] if isinstance(value, list) else value.to(device)
