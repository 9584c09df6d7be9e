"""Shared DataModule machinery: global batch size, seeded validation split, exact distributed evaluation."""

from __future__ import annotations

from typing import Any

import torch
from lightning import LightningDataModule
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from torch import Tensor
from torch.utils.data import DataLoader

from src.data.components.global_batch import per_replica_batch_size
from src.data.components.in_memory import InMemoryDataset, keep_batch
from src.data.components.resumable_loader import EpochShuffle, ResumableDataLoader
from src.utils.errors import ConfigError
from src.utils.pylogger import RankedLogger
from src.utils.seeding import rank_seed

log = RankedLogger(__name__)


class InMemoryDataModule(LightningDataModule):
    """Base for datasets that fit in memory as tensors.

    * ``batch_size`` is **global**: each data-parallel replica gets ``batch_size // replicas``
      (replicas = DDP world size, or the data-parallel size of a pipeline run; ``dp`` is one
      process and splits the global batch itself). A remainder is an error.
    * Training uses Lightning's injected ``DistributedSampler``, which pads each epoch with
      up to ``replicas - 1`` repeated samples so all ranks step together; the loader drops
      the last incomplete batch.
    * Evaluation uses an unpadded sampler (uneven shards), so distributed val/test metrics
      are computed over every sample exactly once and match a single-device run.
    * Augmentation draws from this rank's own generator (:meth:`augmentation_generator`), so the
      ranks of a DDP run crop and flip differently.
    * ``pin_memory="auto"`` pins the loaders' batches when the trainer runs on a GPU.
    * Training can resume mid-epoch, bit-exact: each epoch's order comes from ``(seed, epoch)``, the
      loader's position is saved in checkpoints (:mod:`src.data.components.resumable_loader`), the
      loaders never draw from the global RNG, and :meth:`generator_states` exposes the augmentation
      streams to :class:`~src.callbacks.resume_state.ResumeRandomState`.

    Subclasses implement :meth:`load_split` and :meth:`transform_batch`.
    """

    batch_size_is_global = True  # the pre-flight checks the global-batch rule for DataModules that say so

    def __init__(
        self,
        data_dir: str = "data/",
        batch_size: int = 128,
        val_size: int = 5000,
        num_workers: int = 0,
        pin_memory: bool | str = "auto",
        seed: int = 12345,
    ) -> None:
        super().__init__()
        if pin_memory not in (True, False, "auto"):
            raise ConfigError(f"data.pin_memory must be true, false or auto (true on a GPU), got {pin_memory!r}")
        if not isinstance(batch_size, int) or batch_size <= 0:
            raise ConfigError(f"data.batch_size must be a positive integer (global batch), got {batch_size!r}")
        if val_size < 0:
            raise ConfigError(f"data.val_size must be >= 0, got {val_size}")
        self.save_hyperparameters(logger=False)
        self.data_train: InMemoryDataset | None = None
        self.data_val: InMemoryDataset | None = None
        self.data_test: InMemoryDataset | None = None
        self._augment_generators: dict[tuple[torch.device, int], torch.Generator] = {}

    def _check_shape(self, **given: int | None) -> None:
        """Configs repeat the data shape for models to interpolate; it must match the dataset."""
        for name, value in given.items():
            actual = getattr(self, name)
            if value is not None and value != actual:
                raise ConfigError(f"data.{name}={value} but {type(self).__name__} provides {actual}: remove the override")

    # -- what subclasses provide -------------------------------------------------
    def load_split(self, train: bool) -> tuple[Tensor, Tensor]:
        """Return ``(inputs, targets)`` tensors of the train or test split."""
        raise NotImplementedError

    def transform_batch(self, inputs: Tensor, training: bool) -> Tensor:
        """Turn a stored batch into model input (normalize; augment when ``training``)."""
        return inputs

    # -- Lightning hooks ---------------------------------------------------------
    def setup(self, stage: str | None = None) -> None:
        replicas, rank = self._replicas()
        log.info(f"data replica {rank}/{replicas}: batch {self.batch_size_per_replica} per replica "
                 f"(global {self.hparams.batch_size})", rank=None)
        if self.data_train is not None:
            return
        inputs, targets = self.load_split(train=True)
        n_val = self.hparams.val_size
        if n_val >= len(inputs):
            raise ConfigError(f"data.val_size={n_val} leaves no training data ({len(inputs)} samples)")
        order = torch.randperm(len(inputs), generator=torch.Generator().manual_seed(self.hparams.seed))
        val_idx, train_idx = order[:n_val], order[n_val:]
        self.data_train = InMemoryDataset(inputs[train_idx], targets[train_idx])
        self.data_val = InMemoryDataset(inputs[val_idx], targets[val_idx])
        self.data_test = InMemoryDataset(*self.load_split(train=False))

    def train_dataloader(self) -> DataLoader:
        if len(self.data_train) < self.batch_size_per_replica * self._replicas()[0]:
            raise ConfigError(
                f"data.batch_size={self.hparams.batch_size} is larger than the training set "
                f"({len(self.data_train)} samples): lower it"
            )
        sampler = EpochShuffle(self.data_train, seed=self.hparams.seed)
        return self._loader(self.data_train, sampler=sampler, drop_last=True, loader_class=ResumableDataLoader)

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader(self.data_val)

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader(self.data_test)

    def on_after_batch_transfer(self, batch: tuple[Tensor, Tensor], dataloader_idx: int) -> tuple[Tensor, Tensor]:
        inputs, targets = batch
        training = self.trainer is not None and self.trainer.training
        inputs = self.transform_batch(inputs, training=training)
        if self.trainer is not None:  # Lightning converts the stored batch, but the transform makes new floats:
            inputs = self.trainer.precision_plugin.convert_input(inputs)  # bf16-true/16-true models need them cast
        return inputs, targets

    def state_dict(self) -> dict[str, Any]:
        return {"batch_size": self.hparams.batch_size, "seed": self.hparams.seed}

    # -- helpers -----------------------------------------------------------------
    def _replicas(self) -> tuple[int, int]:
        """(number of data-parallel replicas, this replica's index) from the trainer's strategy."""
        strategy = getattr(self.trainer, "strategy", None)
        kwargs = getattr(strategy, "distributed_sampler_kwargs", None) or {}
        return int(kwargs.get("num_replicas", 1)), int(kwargs.get("rank", 0))

    @property
    def batch_size_per_replica(self) -> int:
        """This replica's share of the global ``batch_size`` (the whole batch before a Trainer is attached)."""
        strategy = getattr(self.trainer, "strategy", None)
        return per_replica_batch_size(self.hparams.batch_size, strategy) if strategy else self.hparams.batch_size

    @property
    def pin_memory(self) -> bool:
        """``data.pin_memory``; ``auto`` pins when the trainer runs on a GPU.

        Lightning copies a batch to the GPU with ``non_blocking=True``, which overlaps the copy with
        compute only from page-locked (pinned) memory. On a CPU run pinning is a wasted copy.
        """
        if self.hparams.pin_memory != "auto":
            return bool(self.hparams.pin_memory)
        return isinstance(getattr(self.trainer, "accelerator", None), CUDAAccelerator)

    def augmentation_generator(self, device: torch.device) -> torch.Generator:
        """This rank's generator on ``device`` for random augmentation, seeded from ``seed`` and the global rank.

        Every rank is seeded alike (equal initial weights); a shared stream would give every rank the
        same crops and flips. Without a trainer (rank 0) the stream is that of a one-process run.
        """
        rank = self.trainer.global_rank if self.trainer is not None else 0
        key = (torch.device(device), rank)
        if key not in self._augment_generators:
            seed = rank_seed(self.hparams.seed, rank, "augment")
            self._augment_generators[key] = torch.Generator(device=key[0]).manual_seed(seed)
        return self._augment_generators[key]

    def generator_states(self) -> dict[str, Tensor]:
        """This rank's augmentation streams, by device, for checkpoints (see :meth:`augmentation_generator`)."""
        return {str(device): gen.get_state() for (device, _), gen in self._augment_generators.items()}

    def load_generator_states(self, states: dict[str, Tensor]) -> None:
        """Continue the augmentation streams saved by :meth:`generator_states` on this rank."""
        for device, state in states.items():
            self.augmentation_generator(torch.device(device)).set_state(state)

    def _loader(self, dataset: InMemoryDataset, loader_class: type[DataLoader] = DataLoader, **kwargs: Any) -> DataLoader:
        workers = self.hparams.num_workers
        return loader_class(
            dataset,
            batch_size=self.batch_size_per_replica,
            collate_fn=keep_batch,
            num_workers=workers,
            pin_memory=self.pin_memory,
            persistent_workers=workers > 0,
            # workers' base seed: from this generator, not the global RNG (which a resumed run restores)
            generator=torch.Generator().manual_seed(self.hparams.seed),
            **kwargs,
        )

    def _eval_loader(self, dataset: InMemoryDataset) -> DataLoader:
        replicas, rank = self._replicas()
        if replicas == 1:
            return self._loader(dataset, shuffle=False)
        # A DistributedSampler subclass, so Lightning keeps it instead of injecting a padded one.
        sampler = UnrepeatedDistributedSampler(dataset, num_replicas=replicas, rank=rank, shuffle=False)
        return self._loader(dataset, sampler=sampler)
