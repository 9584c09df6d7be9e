"""Shared DataModule machinery: global batch size, seeded validation split, exact distributed evaluation."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from lightning import LightningDataModule
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from torch import Tensor
from torch.utils.data import DataLoader

from src.engine.data.batch_transforms import normalize, to_unit_float
from src.engine.data.folds import check_fold, stratified_folds
from src.engine.data.in_memory import InMemoryDataset, keep_batch
from src.engine.data.resumable_loader import GlobalBatchShuffle, ResumableDataLoader
from src.engine.strategies.global_batch import data_replica, per_replica_batch_size
from src.engine.utils.errors import ConfigError
from src.engine.utils.pylogger import RankedLogger
from src.engine.utils.seeding import rank_seed

log = RankedLogger(__name__)


class InMemoryDataModule(LightningDataModule):
    """Base for datasets that fit in memory as tensors.

    * ``batch_size`` is **global**: each data-parallel replica gets ``batch_size // replicas``
      (replicas = DDP world size, or the data-parallel size of a pipeline run; ``dp`` is one
      process and splits the global batch itself). A remainder is an error.
    * Training cuts each epoch's order into global batches and gives each replica its slice of every one
      (:class:`~src.engine.data.resumable_loader.GlobalBatchShuffle`): the samples and their order do
      not depend on the number of ranks, and the last incomplete global batch is dropped.
    * Evaluation uses an unpadded sampler (uneven shards), so distributed val/test metrics
      are computed over every sample exactly once and match a single-device run.
    * Augmentation draws from this rank's own generator (:meth:`augmentation_generator`), so the
      ranks of a DDP run crop and flip differently.
    * Where the data lives (``on_device``): with ``auto``, on the trainer's GPU when it fits in a quarter
      of the free memory, so a batch is one indexing op there and nothing crosses PCIe per step (the
      training loader copies each epoch's order there once and cuts every batch from it there:
      ``index_device`` of :class:`~src.engine.data.resumable_loader.ResumableDataLoader`); on a CPU
      trainer, in host memory. Either way image data is normalized once at set-up, which is exact: a
      crop pads with the normalized value of black. Otherwise (a GPU, ``on_device: false`` or too large)
      uint8 batches are copied from pinned memory (``pin_memory="auto"``) and normalized on the device.
    * Training can resume mid-epoch, bit-exact: each epoch's order comes from ``(seed, epoch)``, the
      loader's position is saved in checkpoints (:mod:`src.engine.data.resumable_loader`), the
      loaders never draw from the global RNG, and :meth:`generator_states` exposes the augmentation
      streams to :class:`~src.engine.checkpointing.resume_state.ResumeRandomState`.

    Subclasses implement :meth:`load_split`, set ``mean``/``std`` for uint8 image data, and may
    :meth:`augment` training batches.
    """

    batch_size_is_global = True  # the pre-flight checks the global-batch rule for DataModules that say so
    mean: tuple[float, ...] | None = None  # per-channel statistics of uint8 images; None: inputs used as they are
    std: tuple[float, ...] | None = None
    ON_DEVICE_SHARE = 0.25  # on_device=auto: the data may take this share of the GPU's free memory

    def __init__(
        self,
        data_dir: str = "data/",
        batch_size: int = 128,
        val_size: int = 5000,
        num_workers: int = 0,
        pin_memory: bool | str = "auto",
        seed: int = 12345,
        on_device: bool | str = "auto",
        n_folds: int | None = None,
        fold: int = 0,
    ) -> None:
        super().__init__()
        check_fold(n_folds, fold)
        if pin_memory not in (True, False, "auto"):
            raise ConfigError(f"data.pin_memory={pin_memory!r} is not true, false or auto; fix: set one of them (auto: pinned on a GPU)")
        if on_device not in (True, False, "auto"):
            raise ConfigError(f"data.on_device={on_device!r} is not true, false or auto; fix: set one of them (auto: on the GPU when it fits)")
        if not isinstance(batch_size, int) or batch_size <= 0:
            raise ConfigError(f"data.batch_size={batch_size!r} is not a positive integer; fix: set the global batch, e.g. data.batch_size=128")
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ConfigError(f"data.num_workers={num_workers!r} must be 0 or more; fix: set data.num_workers=0 (the "
                              "data is in memory: workers rarely help)")
        if val_size < 0:
            raise ConfigError(f"data.val_size={val_size} is negative; fix: set it to 0 or more")
        self.save_hyperparameters(logger=False)
        self.data_train: InMemoryDataset | None = None
        self.data_val: InMemoryDataset | None = None
        self.data_test: InMemoryDataset | None = None
        self.data_device: torch.device | None = None  # where the datasets live once placed (None: host, uint8)
        self._augment_generators: dict[tuple[torch.device, int], torch.Generator] = {}
        self._black: dict[torch.device, Tensor] = {}

    def _check_shape(self, **given: int | None) -> None:
        """Configs repeat the data shape for models to interpolate; it must match the dataset."""
        for name, value in given.items():
            actual = getattr(self, name)
            if value is not None and value != actual:
                raise ConfigError(f"data.{name}={value} but {type(self).__name__} provides {actual}; fix: remove the override")

    # -- what subclasses provide -------------------------------------------------
    def load_split(self, train: bool) -> tuple[Tensor, Tensor]:
        """Return ``(inputs, targets)`` tensors of the train or test split."""
        raise NotImplementedError

    @property
    def input_shape(self) -> tuple[int, ...]:
        """The shape of one sample as the model takes it (``(C, H, W)`` for images); exports trace with it."""
        return (self.channels, self.image_size, self.image_size)

    def augment(self, images: Tensor) -> Tensor:
        """Random augmentation of a normalized training batch, drawn from :meth:`augmentation_generator` (none
        by default)."""
        return images

    # -- model input ---------------------------------------------------------------
    def normalize(self, inputs: Tensor) -> Tensor:
        """uint8 images to normalized float32 (per channel); other inputs, and normalized ones, unchanged."""
        if self.mean is None or inputs.is_floating_point():
            return inputs
        return normalize(to_unit_float(inputs), self.mean, self.std)

    def black(self, device: torch.device) -> Tensor:
        """A black pixel after :meth:`normalize`, per channel ``(1, C, 1, 1)``: the border of a crop."""
        if device not in self._black:
            zero = torch.zeros((1, len(self.mean), 1, 1), dtype=torch.uint8, device=device)
            self._black[device] = self.normalize(zero)
        return self._black[device]

    def transform_batch(self, inputs: Tensor, training: bool) -> Tensor:
        """Turn a stored batch (uint8, or normalized at set-up) into model input; augment when ``training``."""
        images = self.normalize(inputs)
        return self.augment(images) if training else images

    # -- Lightning hooks ---------------------------------------------------------
    @staticmethod
    def split_settings(hparams: Mapping[str, Any]) -> dict[str, Any]:
        """The settings that choose the training and validation samples in :meth:`setup`: the folds and the
        fold under k-fold cross-validation, else the validation size; the seed either way."""
        keys = ("n_folds", "fold", "seed") if hparams.get("n_folds") else ("n_folds", "val_size", "seed")
        return {key: hparams.get(key) for key in keys}

    def setup(self, stage: str | None = None) -> None:
        replicas, rank = self._replicas()
        log.info(f"data replica {rank}/{replicas}: batch {self.batch_size_per_replica} per replica "
                 f"(global {self.hparams.batch_size})", rank=None)
        if self.data_train is not None:
            return
        inputs, targets = self.load_split(train=True)
        if self.hparams.n_folds:  # k-fold cross-validation: fold `fold` validates, the others train
            folds = stratified_folds(targets, self.hparams.n_folds, self.hparams.seed)
            val_idx = folds[self.hparams.fold]
            train_idx = torch.cat([f for k, f in enumerate(folds) if k != self.hparams.fold]).sort().values
        else:
            n_val = self.hparams.val_size
            if n_val >= len(inputs):
                raise ConfigError(f"data.val_size={n_val} leaves no training data ({len(inputs)} samples); fix: lower data.val_size")
            order = torch.randperm(len(inputs), generator=torch.Generator().manual_seed(self.hparams.seed))
            val_idx, train_idx = order[:n_val], order[n_val:]
        self.data_train = InMemoryDataset(inputs[train_idx], targets[train_idx])
        self.data_val = InMemoryDataset(inputs[val_idx], targets[val_idx])
        self.data_test = InMemoryDataset(*self.load_split(train=False))
        self._place()

    def _place(self) -> None:
        """Move the datasets where they are used and normalize them once (see the class docstring)."""
        device = self._placement()
        if device is None:
            return
        datasets = (self.data_train, self.data_val, self.data_test)
        for ds in datasets:  # uint8 crosses to the device, then it is normalized there
            ds.inputs, ds.targets = self.normalize(ds.inputs.to(device)), ds.targets.to(device)
        self.data_device = device
        where = "the GPU" if device.type == "cuda" else "host memory"
        log.info(f"data on {device} ({where}), normalized once: {sum(ds.nbytes for ds in datasets) / 2**20:.0f} MiB",
                 rank=None)

    def _placement(self) -> torch.device | None:
        """The device the datasets live on: the trainer's (GPU when they fit, or CPU); None keeps host uint8."""
        device = getattr(getattr(self.trainer, "strategy", None), "root_device", None)
        if device is None or self.hparams.on_device is False:
            return None
        if device.type == "cpu":
            return device
        if device.type != "cuda":
            return device if self.hparams.on_device is True else None
        need = 4 * sum(ds.inputs.numel() for ds in (self.data_train, self.data_val, self.data_test))
        fits = need <= self.ON_DEVICE_SHARE * torch.cuda.mem_get_info(device)[0]
        if self.hparams.on_device is True or fits:
            return device
        log.info(f"data ({need / 2**20:.0f} MiB as float32) does not fit in {self.ON_DEVICE_SHARE:.0%} of the free "
                 f"memory of {device}: uint8 batches are copied from pinned memory instead", rank=None)
        return None

    def train_dataloader(self) -> DataLoader:
        if len(self.data_train) < self.batch_size_per_replica * self._replicas()[0]:
            raise ConfigError(
                f"data.batch_size={self.hparams.batch_size} is larger than the training set "
                f"({len(self.data_train)} samples); fix: lower it"
            )
        replicas, rank = self._replicas()
        sampler = GlobalBatchShuffle(self.data_train, seed=self.hparams.seed, global_batch=self.hparams.batch_size,
                                     num_replicas=replicas, rank=rank)
        return self._loader(self.data_train, sampler=sampler, drop_last=True, loader_class=ResumableDataLoader,
                            index_device=self._index_device())

    def _index_device(self) -> torch.device | None:
        """Where the training loader cuts its batches: the data's device when the data lives there (once placed)
        and the batches are made in this process, unpinned; None keeps the host path (a host list per batch)."""
        if self.data_device is None or self.pin_memory or self._workers():
            return None
        return self.data_device

    def val_dataloader(self) -> DataLoader:
        return self.eval_loader(self.data_val)

    def test_dataloader(self) -> DataLoader:
        return self.eval_loader(self.data_test)

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
        return data_replica(getattr(self.trainer, "strategy", None))

    @property
    def batch_size_per_replica(self) -> int:
        """This replica's share of the global ``batch_size`` (the whole batch before a Trainer is attached)."""
        strategy = getattr(self.trainer, "strategy", None)
        return per_replica_batch_size(self.hparams.batch_size, strategy) if strategy else self.hparams.batch_size

    @property
    def pin_memory(self) -> bool:
        """``data.pin_memory``; ``auto`` pins when the trainer runs on a GPU and the data is on the host.

        Lightning copies a batch to the GPU with ``non_blocking=True``, which overlaps the copy with
        compute only from page-locked (pinned) memory. On a CPU run pinning is a wasted copy, and data
        already on the GPU is not copied at all.
        """
        if self.data_device is not None and self.data_device.type != "cpu":
            return False
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
        workers = self._workers()
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

    def _workers(self) -> int:
        """``data.num_workers``, or 0 for data on a GPU: its batches are made in this process (workers cannot use
        its memory)."""
        on_gpu = self.data_device is not None and self.data_device.type != "cpu"
        return 0 if on_gpu else self.hparams.num_workers

    def eval_loader(self, dataset: InMemoryDataset) -> DataLoader:
        """In order, each sample once across ranks (validation, test and prediction)."""
        replicas, rank = self._replicas()
        if replicas == 1:
            return self._loader(dataset, shuffle=False)
        # A DistributedSampler subclass, so Lightning keeps it instead of injecting a padded one.
        sampler = UnrepeatedDistributedSampler(dataset, num_replicas=replicas, rank=rank, shuffle=False)
        return self._loader(dataset, sampler=sampler)
