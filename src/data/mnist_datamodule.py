"""MNIST and Fashion-MNIST, read with torchvision's IDX readers and held in memory as uint8 tensors."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torchvision import datasets
from torchvision.datasets.mnist import read_image_file, read_label_file
from torchvision.datasets.utils import extract_archive

from src.data.components.data_dir import check_writable_dir, publish_whole
from src.engine import DataError, InMemoryDataModule, random_crop, random_hflip

# torchvision class (folder layout, download mirrors), per-channel mean/std of the train set.
_DATASETS = {
    "mnist": (datasets.MNIST, (0.1307,), (0.3081,)),
    "fashion_mnist": (datasets.FashionMNIST, (0.2860,), (0.3530,)),
}
# Where Debian/Ubuntu's `dataset-fashion-mnist` package installs the gzipped IDX files.
SYSTEM_DIRS = {"fashion_mnist": "/usr/share/datasets/fashion-mnist"}


class MNISTDataModule(InMemoryDataModule):
    """28x28 grayscale, 10 classes; ``dataset`` is ``mnist`` (the default, as the class name says) or
    ``fashion_mnist`` (:class:`FashionMNISTDataModule`, the template's offline default).

    ``prepare_data`` (rank 0 of each node only) finds the files in this order:
    ``data_dir/<Class>/raw``; the system folder (``system_dir``), extracted into
    ``data_dir``; a download by torchvision when ``download`` is true.
    """

    channels, image_size, num_classes = 1, 28, 10
    task = "classification"  # pairs with models of the same task (src/engine/utils/config_checks.py)
    fetches_data_in_prepare = True  # the pre-flight runs prepare_data before any rank starts

    def __init__(
        self,
        dataset: str = "mnist",
        data_dir: str = "data/",
        system_dir: str | None = None,
        download: bool = True,
        batch_size: int = 128,
        val_size: int = 5000,
        num_workers: int = 0,
        pin_memory: bool | str = "auto",
        seed: int = 12345,
        on_device: bool | str = "auto",
        channels: int | None = None,
        image_size: int | None = None,
        num_classes: int | None = None,
        augment: bool = False,
        n_folds: int | None = None,
        fold: int = 0,
    ) -> None:
        if dataset not in _DATASETS:
            raise DataError(f"unknown data.dataset={dataset!r}; fix: choose one of {sorted(_DATASETS)}")
        super().__init__(data_dir, batch_size, val_size, num_workers, pin_memory, seed, on_device, n_folds, fold)
        self._check_shape(channels=channels, image_size=image_size, num_classes=num_classes)
        self.dataset_cls, self.mean, self.std = _DATASETS[dataset]
        self.system_dir = system_dir if system_dir is not None else SYSTEM_DIRS.get(dataset)

    @property
    def raw_dir(self) -> Path:
        return Path(self.hparams.data_dir) / self.dataset_cls.__name__ / "raw"

    def _raw_files(self) -> list[Path]:
        return [self.raw_dir / Path(name).name.removesuffix(".gz") for name, _ in self.dataset_cls.resources]

    def check_data_dir(self) -> None:
        """When the files are not there yet, their folder must be writable."""
        if not all(f.is_file() for f in self._raw_files()):
            check_writable_dir(self.raw_dir, f"the {self.hparams.dataset} files")

    def prepare_data(self) -> None:
        if all(f.is_file() for f in self._raw_files()):
            return
        self.check_data_dir()
        if self.system_dir and all(
            (Path(self.system_dir) / f"{f.name}.gz").is_file() for f in self._raw_files()
        ):
            self._extract_from(Path(self.system_dir))
            return
        if not self.hparams.download:
            raise DataError(self._not_found("downloads are disabled (data.download=false)"))
        names = [str(f.relative_to(self.hparams.data_dir)) for f in self._raw_files()]  # raw_dir owns the layout
        try:  # torchvision writes <data_dir>/<Class>/raw/: into a temporary data_dir, then renamed into place
            publish_whole(self.hparams.data_dir, lambda tmp: self.dataset_cls(tmp, train=True, download=True), names)
        except Exception as err:  # network errors come in many types
            raise DataError(self._not_found(f"the download failed: {type(err).__name__}: {err}")) from err

    def _extract_from(self, source: Path) -> None:
        """Extract each file into a temporary folder, then rename it into place (:func:`publish_whole`)."""

        def extract(folder: Path) -> None:
            for target in self._raw_files():
                archive = source / f"{target.name}.gz"
                try:
                    extract_archive(str(archive), str(folder))
                except (OSError, EOFError) as err:
                    raise DataError(
                        f"cannot extract {archive}: {err}; fix: reinstall the package that provides it"
                    ) from err

        publish_whole(self.raw_dir, extract, [f.name for f in self._raw_files()])

    def _not_found(self, reason: str) -> str:
        name = self.hparams.dataset
        fixes = [f"put the four IDX files in {self.raw_dir}"]
        if name in SYSTEM_DIRS:
            fixes.insert(0, "install them offline with `sudo apt-get install dataset-fashion-mnist`")
        fixes.append("or allow internet access for the download")
        where = f"{self.raw_dir} or {self.system_dir or 'a system folder'}"
        return f"{name} not found in {where} and {reason}; fix: " + ", ".join(fixes)

    def load_split(self, train: bool) -> tuple[Tensor, Tensor]:
        images_file, labels_file = self._raw_files()[0:2] if train else self._raw_files()[2:4]
        for path in (images_file, labels_file):
            if not path.is_file():
                raise DataError(self._not_found("prepare_data did not provide it") + f" (missing {path})")
        images = _read(read_image_file, images_file)
        labels = _read(read_label_file, labels_file)
        if images.ndim != 3 or len(images) != len(labels):
            raise DataError(
                f"{images_file} and {labels_file} disagree ({tuple(images.shape)} vs {len(labels)} labels); "
                "fix: delete them and re-run to extract or download fresh copies"
            )
        return images.unsqueeze(1).contiguous(), labels.long()

    def augment(self, images: Tensor) -> Tensor:
        if not self.hparams.augment:
            return images
        generator = self.augmentation_generator(images.device)
        images = random_crop(images, padding=2, generator=generator, fill=self.black(images.device))
        if self.hparams.dataset == "fashion_mnist":  # clothing is left-right symmetric; digits are not
            images = random_hflip(images, generator=generator)
        return images



class FashionMNISTDataModule(MNISTDataModule):
    """Fashion-MNIST: MNIST's format and size, clothing instead of digits. Debian/Ubuntu install it offline
    (``dataset-fashion-mnist``), which makes it the template's default data (``configs/data/fashion_mnist.yaml``)."""

    def __init__(self, dataset: str = "fashion_mnist", **kwargs: Any) -> None:
        super().__init__(dataset=dataset, **kwargs)


def _read(reader, path: Path) -> Tensor:
    """Read one IDX file with torchvision's reader, turning any parse failure into a DataError naming it."""
    try:
        return torch.as_tensor(reader(os.fspath(path)))
    except Exception as err:
        raise DataError(
            f"corrupt data file {path} ({type(err).__name__}: {err}); fix: delete it and re-run to restore it"
        ) from err
