"""The offline Fashion-MNIST files are extracted so that a process sharing the data folder never reads half a file."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

import src.data.mnist_datamodule as mnist_datamodule
from src.data.mnist_datamodule import SYSTEM_DIRS, FashionMNISTDataModule

SYSTEM = Path(SYSTEM_DIRS["fashion_mnist"])


@pytest.mark.fast
@pytest.mark.skipif(not SYSTEM.is_dir(), reason=f"needs the dataset-fashion-mnist package ({SYSTEM})")
def test_each_file_appears_whole_or_not_at_all(tmp_path, monkeypatch):
    dm = FashionMNISTDataModule(data_dir=str(tmp_path), download=False)
    seen_while_writing: dict[str, bool] = {}
    real_extract = mnist_datamodule.extract_archive

    def watched_extract(archive: str, to_path: str) -> None:
        real_extract(archive, to_path)  # the whole file is written now; a reader must not find it under its name yet
        name = Path(archive).name.removesuffix(".gz")
        seen_while_writing[name] = (dm.raw_dir / name).exists()

    monkeypatch.setattr(mnist_datamodule, "extract_archive", watched_extract)
    dm.prepare_data()
    names = [f.name for f in dm._raw_files()]
    assert seen_while_writing == dict.fromkeys(names, False), "a file was visible under its name while being written"
    for name in names:
        assert (dm.raw_dir / name).read_bytes() == gzip.decompress((SYSTEM / f"{name}.gz").read_bytes())
    assert sorted(p.name for p in dm.raw_dir.iterdir()) == sorted(names), "temporary files were left behind"
    assert len(dm.load_split(train=False)[0]) == 10_000
