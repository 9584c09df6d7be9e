"""Read data pickles that can run no code: ``pickle.Unpickler`` with a closed list of globals.

``pickle.load`` calls whatever a file names (``os.system``, ``builtins.exec``, ...), so a crafted
file dropped into a data folder would run as the training user. Plain containers (dicts, lists,
str, bytes, ints) need no globals; everything a file asks for by name is looked up in ``allowed``,
and anything else stops the read before it is called.
"""

from __future__ import annotations

import codecs
import os
import pickle
from collections.abc import Mapping
from typing import Any


class RefusedGlobal(pickle.UnpicklingError):
    """The pickle asked for a global outside the allowed set; nothing it names was called."""

    def __init__(self, module: str, name: str) -> None:
        super().__init__(f"{module}.{name}")
        self.module, self.name = module, name


def _latin1_encode(obj: str, encoding: str = "utf-8", errors: str = "strict") -> bytes:
    """``_codecs.encode`` as protocol-2 pickles of ``bytes`` use it (``encode(text, 'latin1')``), nothing else."""
    if codecs.lookup(encoding).name != "iso8859-1" or not isinstance(obj, str):
        raise RefusedGlobal("_codecs", f"encode(..., {encoding!r})")
    return codecs.encode(obj, "latin1", errors)


def _numpy_array_globals() -> dict[tuple[str, str], Any]:
    import numpy as np

    reconstruct = np.ndarray.__reduce__(np.zeros(0))[0]  # numpy's own _reconstruct, wherever it lives now
    return {
        ("numpy.core.multiarray", "_reconstruct"): reconstruct,  # written by numpy < 2 (real CIFAR-10)
        ("numpy._core.multiarray", "_reconstruct"): reconstruct,  # written by numpy >= 2
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
        ("_codecs", "encode"): _latin1_encode,  # bytes in a protocol-2 pickle written by Python 3
    }


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler whose ``find_class`` answers only the ``(module, name)`` pairs in ``allowed``."""

    def __init__(self, file: Any, allowed: Mapping[tuple[str, str], Any], **kwargs: Any) -> None:
        super().__init__(file, **kwargs)
        self.allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self.allowed[(module, name)]
        except KeyError:
            raise RefusedGlobal(module, name) from None


def load_numpy_pickle(path: str | os.PathLike) -> Any:
    """Unpickle ``path`` (latin1, as Python 2 files need) allowing plain containers and numpy arrays only.

    Raises :class:`RefusedGlobal` when the file names any other global.
    """
    with open(path, "rb") as f:
        return RestrictedUnpickler(f, _numpy_array_globals(), encoding="latin1").load()
