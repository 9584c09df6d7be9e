"""For the tests: what W&B holds of a run, read from the run's transaction logs (``run-<id>.wandb``).

W&B writes every record it is sent, online or offline, to a transaction log in the run's attempt directory
(``wandb/offline-run-<time>-<id>/`` or ``wandb/run-<time>-<id>/``): a 7-byte header (``:W&B``, a 2-byte
magic, a version byte), then LevelDB's log format (32 KiB blocks; each chunk a 4-byte checksum, a 2-byte
length and a type: full, first, middle, last) around serialized ``wandb_internal_pb2.Record`` messages.

Own code because nothing else reads it: the wandb package moved its reader into its Go core, and an offline
run has no server to ask. A log cut short by a kill ends where its last whole record ends; a file in a
format this reader does not know is reported as holding nothing.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

STEP_KEY = "trainer/global_step"  # Lightning's WandbLogger sends the step with every point under this key
_HEADER = b":W&B"
_HEADER_SIZE, _BLOCK, _CHUNK_HEADER = 7, 32 * 1024, struct.Struct("<IHB")
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4
_W_AND_B_OWN = ("_step", "_runtime", "_timestamp")


def transaction_logs(wandb_dir: str | Path, run_id: str) -> list[Path]:
    """Every attempt's transaction log of W&B run ``run_id`` under ``wandb_dir`` (``<save_dir>/wandb``)."""
    return sorted(Path(wandb_dir).glob(f"*-{run_id}/run-{run_id}.wandb"))


def records(path: Path) -> Iterator[Any]:
    """Each whole ``wandb_internal_pb2.Record`` in one transaction log, in order."""
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2

    for payload in _payloads(path.read_bytes()):
        record = wandb_internal_pb2.Record()
        try:
            record.ParseFromString(payload)
        except DecodeError:  # torn by a kill: what follows was never whole
            return
        yield record


def history_points(path: Path) -> Iterator[dict[str, Any]]:
    """Each history point (metric -> value, the step under ``STEP_KEY``) in one transaction log, in order."""
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            point = {item_key(item): json.loads(item.value_json) for item in record.history.item}
            yield {k: v for k, v in point.items() if k not in _W_AND_B_OWN}


def item_key(item: Any) -> str:
    """A history or config item's key (W&B splits some keys into a nested path)."""
    return item.key or "/".join(item.nested_key)


def _payloads(data: bytes) -> Iterator[bytes]:
    if data[:len(_HEADER)] != _HEADER:
        return
    pos, parts = _HEADER_SIZE, b""
    while True:
        if _BLOCK - pos % _BLOCK < _CHUNK_HEADER.size:  # a block's tail too short for a chunk header is padding
            pos += _BLOCK - pos % _BLOCK
        if pos + _CHUNK_HEADER.size > len(data):
            return
        _, length, kind = _CHUNK_HEADER.unpack_from(data, pos)
        start, pos = pos + _CHUNK_HEADER.size, pos + _CHUNK_HEADER.size + length
        if pos > len(data):  # cut short by a kill
            return
        chunk = data[start:pos]
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            parts = chunk
        elif kind == _MIDDLE:
            parts += chunk
        elif kind == _LAST:
            yield parts + chunk
        else:  # zeroed tail or a format this reader does not know
            return
