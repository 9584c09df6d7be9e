"""Data files are extracted and downloaded so that a process sharing the data folder never reads half a file."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

import src.data.mnist_datamodule as mnist_datamodule
from src.data.components.data_dir import publish_whole
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


@pytest.mark.fast
@pytest.mark.skipif(not SYSTEM.is_dir(), reason=f"needs the dataset-fashion-mnist package ({SYSTEM})")
def test_a_download_appears_whole(tmp_path):
    """torchvision downloads into a temporary data folder; the files are renamed into place only once complete."""
    dm = FashionMNISTDataModule(data_dir=str(tmp_path), system_dir=str(tmp_path / "nowhere"), download=True)
    visible_while_downloading = []

    class FakeDownload:  # torchvision's layout: <root>/FashionMNIST/raw/<files>
        resources = dm.dataset_cls.resources

        def __init__(self, root, train: bool, download: bool) -> None:
            raw = Path(root) / "FashionMNIST" / "raw"
            raw.mkdir(parents=True)
            for name, _ in self.resources:
                (raw / name.removesuffix(".gz")).write_bytes(gzip.decompress((SYSTEM / name).read_bytes()))
                visible_while_downloading.extend(dm.raw_dir.glob("*"))

    FakeDownload.__name__ = "FashionMNIST"
    dm.dataset_cls = FakeDownload
    dm.prepare_data()
    assert visible_while_downloading == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["FashionMNIST"], "the temporary folder was left behind"
    assert len(dm.load_split(train=True)[0]) == 60_000


@pytest.mark.fast
def test_a_folder_another_process_published_first_is_kept(tmp_path):
    def make(folder: Path) -> None:
        (folder / "cifar-10-batches-py").mkdir()
        (folder / "cifar-10-batches-py" / "data_batch_1").write_text("mine")

    (tmp_path / "cifar-10-batches-py").mkdir()
    (tmp_path / "cifar-10-batches-py" / "data_batch_1").write_text("theirs")
    publish_whole(tmp_path, make, ["cifar-10-batches-py"])
    assert (tmp_path / "cifar-10-batches-py" / "data_batch_1").read_text() == "theirs"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cifar-10-batches-py"]
    publish_whole(tmp_path / "fresh", make, ["cifar-10-batches-py"])
    assert (tmp_path / "fresh" / "cifar-10-batches-py" / "data_batch_1").read_text() == "mine"


@pytest.mark.fast
def test_a_failed_download_leaves_nothing(tmp_path):
    def make(folder: Path) -> None:
        (folder / "cifar-10-python.tar.gz").write_bytes(b"half")
        raise ConnectionError("network unreachable")

    with pytest.raises(ConnectionError):
        publish_whole(tmp_path, make, ["cifar-10-batches-py"])
    assert list(tmp_path.iterdir()) == []


def test_a_failed_download_into_a_missing_folder_leaves_no_folder(tmp_path):
    """``data.data_dir=/nonexistent/...`` refused after the download failed: nothing is left where it pointed."""
    def make(folder: Path) -> None:
        raise ConnectionError("network unreachable")

    root = tmp_path / "made" / "for" / "cifar"
    with pytest.raises(ConnectionError):
        publish_whole(root, make, ["cifar-10-batches-py"])
    assert list(tmp_path.iterdir()) == []
