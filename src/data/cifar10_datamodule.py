"""CIFAR-10 in torchvision's on-disk format (``cifar-10-batches-py``), held in memory as uint8 tensors."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor
from torchvision import datasets

from src.data.components.batch_transforms import normalize, random_crop, random_hflip, to_unit_float
from src.data.in_memory_datamodule import InMemoryDataModule
from src.utils.errors import DataError

# Augmentation statistics used by the CIFAR-10 DDP example this template grew from.
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2023, 0.1994, 0.2010)


class _CIFAR10(datasets.CIFAR10):
    """torchvision's reader with the MD5 checks made optional (synthetic test files have other sums)."""

    def __init__(self, root: str, train: bool, verify_checksums: bool) -> None:
        if not verify_checksums:  # torchvision skips the MD5 comparison where the expected sum is None
            self.train_list = [[name, None] for name, _ in datasets.CIFAR10.train_list]
            self.test_list = [[name, None] for name, _ in datasets.CIFAR10.test_list]
            self.meta = {**datasets.CIFAR10.meta, "md5": None}
        super().__init__(root, train=train, download=False)


class CIFAR10DataModule(InMemoryDataModule):
    """32x32 RGB, 10 classes. Training batches get random crop (pad 4) and horizontal flip, on device.

    Downloads happen only in ``prepare_data`` (rank 0 of each node). ``verify_checksums=false``
    accepts files that are in the right format but not the published ones (the synthetic
    files from ``scripts/make_synthetic_cifar10.py``).
    """

    channels, image_size, num_classes = 3, 32, 10

    def __init__(
        self,
        data_dir: str = "data/",
        download: bool = True,
        verify_checksums: bool = True,
        augment: bool = True,
        batch_size: int = 128,
        val_size: int = 5000,
        num_workers: int = 0,
        pin_memory: bool | str = "auto",
        seed: int = 12345,
        channels: int | None = None,
        image_size: int | None = None,
        num_classes: int | None = None,
    ) -> None:
        super().__init__(data_dir, batch_size, val_size, num_workers, pin_memory, seed)
        self._check_shape(channels=channels, image_size=image_size, num_classes=num_classes)

    def prepare_data(self) -> None:
        root = self.hparams.data_dir
        folder = Path(root) / datasets.CIFAR10.base_folder
        if folder.is_dir():
            return
        if not self.hparams.download:
            raise DataError(f"CIFAR-10 not found in {folder} and data.download=false; set data.download=true or "
                            "point data.data_dir at a folder containing cifar-10-batches-py/")
        try:
            datasets.CIFAR10(root, train=True, download=True)
        except Exception as err:  # network errors come in many types
            raise DataError(
                f"CIFAR-10 not found in {folder} and the download failed ({type(err).__name__}: {err}); "
                "copy cifar-10-batches-py/ there, or allow internet access"
            ) from err

    def load_split(self, train: bool) -> tuple[Tensor, Tensor]:
        try:
            ds = _CIFAR10(self.hparams.data_dir, train=train, verify_checksums=self.hparams.verify_checksums)
        except Exception as err:
            hint = "" if not self.hparams.verify_checksums else " (synthetic files need data.verify_checksums=false)"
            raise DataError(
                f"cannot read CIFAR-10 from {Path(self.hparams.data_dir) / datasets.CIFAR10.base_folder}: "
                f"{err}{hint}; delete the folder and re-run to download it again"
            ) from err
        images = torch.from_numpy(ds.data).permute(0, 3, 1, 2).contiguous()  # NHWC -> NCHW, uint8
        return images, torch.as_tensor(ds.targets, dtype=torch.long)

    def transform_batch(self, inputs: Tensor, training: bool) -> Tensor:
        images = to_unit_float(inputs)
        if training and self.hparams.augment:
            generator = self.augmentation_generator(images.device)
            images = random_hflip(random_crop(images, padding=4, generator=generator), generator=generator)
        return normalize(images, CIFAR10_MEAN, CIFAR10_STD)
