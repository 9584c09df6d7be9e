"""CIFAR-10 batch files are read by a restricted unpickler: a crafted pickle in the data folder runs no code.

The files are pickles (``cifar-10-python.tar.gz``), and torchvision reads them with ``pickle.load``, which
calls whatever a file names. The datamodule's reader allows numpy arrays and plain containers only.
"""

from __future__ import annotations

import builtins
import codecs
import io
import os
import pickle
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from torchvision import datasets

from src.data.cifar10_datamodule import CIFAR10DataModule, read_cifar10
from src.engine.utils.errors import DataError
from src.engine.utils.safe_unpickle import RefusedGlobal, load_numpy_pickle
from src.train import train

pytestmark = pytest.mark.faults


class _Payload:
    """Unpickling this calls ``func(*args)``: each attack below only writes a marker file."""

    def __init__(self, func, *args) -> None:
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def _attacks(marker: Path) -> dict[str, object]:
    return {
        "builtins.exec": _Payload(builtins.exec, f"open({str(marker)!r}, 'w').close()"),
        "os.system": _Payload(os.system, f"touch '{marker}'"),
        "builtins.open": _Payload(builtins.open, str(marker), "w"),
        "_codecs.encode": _Payload(codecs.encode, str(marker), "rot13"),  # allowed only as latin1 for bytes
    }


def _crafted_batch(payload: object) -> dict:
    data = np.zeros((10, 3072), dtype=np.uint8)
    return {"batch_label": "training batch 1 of 5", "labels": [0] * 10, "data": data, "filenames": payload}


@pytest.fixture
def cifar_copy(synthetic_cifar10, tmp_path) -> Path:
    """A private copy of the session's synthetic CIFAR-10 folder (the tests overwrite its files)."""
    shutil.copytree(synthetic_cifar10, tmp_path / "cifar")
    return tmp_path / "cifar"


def _datamodule(root: Path, verify_checksums: bool = False) -> CIFAR10DataModule:
    return CIFAR10DataModule(data_dir=str(root), download=False, verify_checksums=verify_checksums, val_size=50,
                             batch_size=10)


# the global each attack names in a protocol-2 file (Python 2 names for builtins; os.system is posix.system)
NAMED = {"builtins.exec": "__builtin__.exec", "os.system": f"{os.name}.system", "builtins.open": "io.open",
         "_codecs.encode": "_codecs.encode(..., 'rot13')"}


@pytest.mark.fast
@pytest.mark.parametrize("attack", list(NAMED))
@pytest.mark.parametrize("file_name", ["data_batch_1", "test_batch", "batches.meta"])
def test_crafted_pickle_is_refused_and_runs_nothing(cifar_copy, tmp_path, attack, file_name):
    control, marker = tmp_path / "control", tmp_path / "marker"
    if attack != "_codecs.encode":  # the payload is real: a plain pickle.load runs it
        pickle.loads(pickle.dumps(_attacks(control)[attack], protocol=2))
        assert control.exists()
    folder = cifar_copy / "cifar-10-batches-py"
    with open(folder / file_name, "wb") as f:
        pickle.dump(_crafted_batch(_attacks(marker)[attack]), f, protocol=2)

    train_split = file_name != "test_batch"
    with pytest.raises(DataError) as err:
        _datamodule(cifar_copy).load_split(train=train_split)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"{folder / file_name} asks the unpickler for {NAMED[attack]}, "), message
    assert "nothing in it was run; fix: " in message
    assert not marker.exists()


@pytest.mark.fast
def test_crafted_pickle_with_checksums_on_is_not_even_opened(cifar_copy, tmp_path):
    marker = tmp_path / "marker"
    with open(cifar_copy / "cifar-10-batches-py" / "data_batch_1", "wb") as f:
        pickle.dump(_crafted_batch(_attacks(marker)["builtins.exec"]), f, protocol=2)
    with pytest.raises(DataError, match=r"data_batch_1 is not the published CIFAR-10 file \(MD5 differs\); fix: "):
        _datamodule(cifar_copy, verify_checksums=True).load_split(train=True)
    assert not marker.exists()


@pytest.mark.fast
def test_genuine_synthetic_files_load_as_torchvision_reads_them(synthetic_cifar10):
    class Unchecked(datasets.CIFAR10):  # torchvision's own reader (plain pickle.load), MD5 checks off
        train_list = [[name, None] for name, _ in datasets.CIFAR10.train_list]
        test_list = [[name, None] for name, _ in datasets.CIFAR10.test_list]
        meta = {**datasets.CIFAR10.meta, "md5": None}

    for train_split in (True, False):
        data, labels = read_cifar10(synthetic_cifar10, train_split, verify_checksums=False)
        reference = Unchecked(str(synthetic_cifar10), train=train_split)
        assert np.array_equal(data, reference.data.transpose(0, 3, 1, 2)) and labels == reference.targets
    images, targets = _datamodule(synthetic_cifar10).load_split(train=True)
    assert images.shape == (300, 3, 32, 32) and targets.shape == (300,)


class _Py2Pickler(pickle._Pickler):
    """Writes what Python 2's cPickle wrote into the real CIFAR-10 files: byte strings for ``str``, and
    ``numpy.core.multiarray._reconstruct`` (numpy >= 2 writes ``numpy._core``)."""

    dispatch = dict(pickle._Pickler.dispatch)

    def _binstring(self, data: bytes) -> None:
        n = len(data)
        self.write(pickle.SHORT_BINSTRING + bytes([n]) + data if n < 256 else pickle.BINSTRING + struct.pack("<i", n) + data)

    def save_bytes(self, obj: bytes) -> None:
        self._binstring(obj)
        self.memoize(obj)

    def save_str(self, obj: str) -> None:
        self._binstring(obj.encode("latin1"))
        self.memoize(obj)

    def save_global(self, obj, name=None) -> None:
        if getattr(obj, "__name__", "") == "_reconstruct":
            self.write(pickle.GLOBAL + b"numpy.core.multiarray\n_reconstruct\n")
            self.memoize(obj)
        else:
            super().save_global(obj, name)

    dispatch[bytes], dispatch[str], dispatch[type] = save_bytes, save_str, save_global


@pytest.mark.fast
def test_python2_era_files_load(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, size=(4, 3072), dtype=np.uint8)
    buf = io.BytesIO()
    _Py2Pickler(buf, protocol=2).dump({"batch_label": "training batch 1 of 5", "labels": [1, 2, 3, 4], "data": data})
    assert b"numpy.core.multiarray\n_reconstruct" in buf.getvalue() and b"_codecs" not in buf.getvalue()
    (tmp_path / "batch").write_bytes(buf.getvalue())
    entry = load_numpy_pickle(tmp_path / "batch")
    assert np.array_equal(entry["data"], data) and entry["labels"] == [1, 2, 3, 4]


@pytest.mark.fast
def test_only_the_numpy_array_globals_are_allowed(tmp_path):
    path = tmp_path / "p"
    path.write_bytes(pickle.dumps({"a": np.arange(3, dtype=np.uint8), "b": b"\x00\xff", "c": ["x", 1]}, protocol=2))
    assert load_numpy_pickle(path)["b"] == b"\x00\xff"
    for proto in (2, 4):  # another numpy name, in either protocol's way of naming globals
        path.write_bytes(pickle.dumps(_Payload(np.load, str(tmp_path / "x.npy")), protocol=proto))
        with pytest.raises(RefusedGlobal, match=r"numpy\.load"):
            load_numpy_pickle(path)


@pytest.mark.fast
def test_train_entry_stops_with_one_line(make_cfg, cifar_copy, tmp_path, capsys):
    marker = tmp_path / "marker"
    with open(cifar_copy / "cifar-10-batches-py" / "data_batch_1", "wb") as f:
        pickle.dump(_crafted_batch(_attacks(marker)["os.system"]), f, protocol=2)
    cfg = make_cfg("train", ["data=cifar10", "model=mlp", f"data.data_dir={cifar_copy}", "data.download=false",
                             "data.verify_checksums=false", "data.val_size=50"])
    with pytest.raises(SystemExit) as exit_info:
        train(cfg)
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and f"data_batch_1 asks the unpickler for {NAMED['os.system']}, " in errors[0], errors
    assert not marker.exists()
