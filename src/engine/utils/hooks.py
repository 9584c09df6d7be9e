"""The hooks one room calls on another's objects, typed.

A strategy, DataModule, LightningModule, logger or callback offers a hook by defining it; the caller asks
``isinstance(obj, <Protocol>)`` instead of looking the name up, so the contract is written down once and
a type checker sees it. Objects that do not offer a hook (Lightning's own, a user's) are left alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import lightning as L
    from torchmetrics import Metric


@runtime_checkable
class ChecksBeforeLaunch(Protocol):
    """A strategy that checks itself against the built trainer, model and data before any rank starts."""

    def check_before_launch(self, trainer: L.Trainer, model: L.LightningModule,
                            datamodule: L.LightningDataModule | None) -> None: ...


@runtime_checkable
class ChecksTrainerConfig(Protocol):
    """A strategy class that checks the trainer config before the Trainer is built."""

    @classmethod
    def check_trainer_config(cls, trainer_cfg: Any) -> None: ...


@runtime_checkable
class FetchesData(Protocol):
    """A DataModule whose ``prepare_data`` only finds, extracts or downloads its files, so a second call does
    nothing: the pre-flight calls it before any rank starts, and missing data is one line, not a failure
    inside the fit."""

    fetches_data_in_prepare: bool


@runtime_checkable
class GlobalBatch(Protocol):
    """A DataModule whose ``batch_size`` is the global batch, split over the data-parallel ranks."""

    batch_size_is_global: bool


@runtime_checkable
class RandomStatePerRank(Protocol):
    """A strategy that says whether its runs replay bit-exact from every rank's random state."""

    random_state_per_rank: bool


@runtime_checkable
class ReplaysLogs(Protocol):
    """A logger that drops what it holds from the first step a resumed fit replays."""

    def replay_starts(self, armed: bool) -> None: ...


@runtime_checkable
class ResumableMetrics(Protocol):
    """A LightningModule whose running metrics a checkpoint keeps."""

    def resumable_metrics(self, mid_epoch: bool) -> dict[str, Metric]: ...


@runtime_checkable
class EndsRunAs(Protocol):
    """A callback that may end a run early on purpose; ``(status, detail)`` for ``status.yaml``, or None."""

    ended_run_as: tuple[str, str] | None


@runtime_checkable
class RunsOwnedStep(Protocol):
    """A strategy that says whether the module may own its training step (manual optimization)."""

    runs_owned_step: bool
