"""CIFAR-10 in torchvision's on-disk format (``cifar-10-batches-py``), held in memory as uint8 tensors.

The batch files are pickles; they are read with a restricted unpickler (:mod:`src.engine.utils.safe_unpickle`)
that allows numpy arrays and nothing else, so a crafted file in the data folder runs no code, whether or not
``data.verify_checksums`` is on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torchvision import datasets
from torchvision.datasets.utils import check_integrity

from src.data.components.data_dir import publish_whole
from src.engine import (
    DataError,
    InMemoryDataModule,
    RefusedGlobal,
    load_numpy_pickle,
    random_crop,
    random_hflip,
)

# Augmentation statistics used by the CIFAR-10 DDP example this template grew from.
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2023, 0.1994, 0.2010)


def _checked(folder: Path, name: str, md5: str | None) -> Path:
    """``folder/name`` when it exists (and, with ``md5``, has the published checksum), else a one-line DataError."""
    path = folder / name
    if not path.is_file():
        raise DataError(f"{path} is missing; fix: delete {folder} and re-run with data.download=true")
    if md5 is not None and not check_integrity(str(path), md5):
        raise DataError(
            f"{path} is not the published CIFAR-10 file (MD5 differs); fix: delete {folder} and re-run to "
            "download it again (synthetic files need data.verify_checksums=false)"
        )
    return path


def _unpickle(path: Path, folder: Path) -> Any:
    """torchvision's ``pickle.load(f, encoding="latin1")``, but a file naming anything beyond numpy arrays
    (``os.system``, ``builtins.exec``, ...) is refused before it is called."""
    try:
        return load_numpy_pickle(path)
    except RefusedGlobal as err:
        raise DataError(
            f"{path} asks the unpickler for {err}, which CIFAR-10 files never hold: refused, nothing in it "
            f"was run; fix: delete {folder} and download it again (or rewrite it with "
            "scripts/make_synthetic_cifar10.py)"
        ) from None


def read_cifar10(root: str | Path, train: bool, verify_checksums: bool) -> tuple[np.ndarray, list[int]]:
    """The images (N, 3, 32, 32) uint8 and labels of one split of ``root/cifar-10-batches-py``.

    The files are torchvision's (the ``cifar-10-python.tar.gz`` layout); with ``verify_checksums`` each
    must have its published MD5 before it is opened.
    """
    folder = Path(root) / datasets.CIFAR10.base_folder
    meta = datasets.CIFAR10.meta
    files = datasets.CIFAR10.train_list if train else datasets.CIFAR10.test_list
    data, labels = [], []
    for name, md5 in files:
        path = _checked(folder, name, md5 if verify_checksums else None)
        entry = _unpickle(path, folder)
        batch = entry.get("data") if isinstance(entry, dict) else None
        batch_labels = (entry.get("labels", entry.get("fine_labels")) if isinstance(entry, dict) else None)
        if (not isinstance(batch, np.ndarray) or batch.dtype != np.uint8 or batch.ndim != 2
                or batch.shape[1] != 3 * 32 * 32 or not isinstance(batch_labels, list)
                or len(batch_labels) != len(batch)):
            raise DataError(f"{path} is not a CIFAR-10 batch (a dict with uint8 'data' of N x 3072 and N "
                            f"'labels'); fix: delete {folder} and download it again")
        data.append(batch)
        labels.extend(batch_labels)
    path = _checked(folder, meta["filename"], meta["md5"] if verify_checksums else None)
    names = _unpickle(path, folder)
    if not isinstance(names, dict) or len(names.get(meta["key"], ())) != 10:
        raise DataError(f"{path} lists no 10 '{meta['key']}'; fix: delete {folder} and download it again")
    return np.vstack(data).reshape(-1, 3, 32, 32), labels


class CIFAR10DataModule(InMemoryDataModule):
    """32x32 RGB, 10 classes. Training batches get random crop (pad 4) and horizontal flip, on device.

    Downloads happen only in ``prepare_data`` (rank 0 of each node). ``verify_checksums=false``
    accepts files that are in the right format but not the published ones (the synthetic
    files from ``scripts/make_synthetic_cifar10.py``).
    """

    task = "classification"  # pairs with models of the same task (src/engine/utils/config_checks.py)
    channels, image_size, num_classes = 3, 32, 10
    fetches_data_in_prepare = True  # the pre-flight runs prepare_data before any rank starts
    mean, std = CIFAR10_MEAN, CIFAR10_STD

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
        on_device: bool | str = "auto",
        channels: int | None = None,
        image_size: int | None = None,
        num_classes: int | None = None,
        n_folds: int | None = None,
        fold: int = 0,
    ) -> None:
        super().__init__(data_dir, batch_size, val_size, num_workers, pin_memory, seed, on_device, n_folds, fold)
        self._check_shape(channels=channels, image_size=image_size, num_classes=num_classes)

    def prepare_data(self) -> None:
        root = self.hparams.data_dir
        folder = Path(root) / datasets.CIFAR10.base_folder
        if folder.is_dir():
            return
        if not self.hparams.download:
            raise DataError(f"CIFAR-10 not found in {folder} and data.download=false; fix: set data.download=true or "
                            "point data.data_dir at a folder containing cifar-10-batches-py/")
        try:  # downloaded and extracted in a temporary folder, then renamed into place whole (publish_whole)
            publish_whole(root, lambda tmp: datasets.CIFAR10(tmp, train=True, download=True), [folder.name])
        except Exception as err:  # network errors come in many types
            raise DataError(
                f"CIFAR-10 not found in {folder} and the download failed ({type(err).__name__}: {err}); fix: "
                "copy cifar-10-batches-py/ there, or allow internet access"
            ) from err

    def load_split(self, train: bool) -> tuple[Tensor, Tensor]:
        try:
            data, labels = read_cifar10(self.hparams.data_dir, train, self.hparams.verify_checksums)
        except DataError:
            raise
        except Exception as err:
            hint = "" if not self.hparams.verify_checksums else " (synthetic files need data.verify_checksums=false)"
            raise DataError(
                f"cannot read CIFAR-10 from {Path(self.hparams.data_dir) / datasets.CIFAR10.base_folder}: "
                f"{type(err).__name__}: {err}{hint}; fix: delete the folder and re-run to download it again"
            ) from err
        return torch.from_numpy(data).contiguous(), torch.as_tensor(labels, dtype=torch.long)  # NCHW, uint8

    def augment(self, images: Tensor) -> Tensor:
        if not self.hparams.augment:
            return images
        generator = self.augmentation_generator(images.device)
        images = random_crop(images, padding=4, generator=generator, fill=self.black(images.device))
        return random_hflip(images, generator=generator)
