"""Per-rank random streams: every rank starts from the same seed (equal initial weights), then draws its own."""

from __future__ import annotations

import hashlib


def rank_seed(seed: int, rank: int, stream: str) -> int:
    """A 64-bit seed for ``stream`` (e.g. ``"model"``, ``"augment"``) on global ``rank``, derived from ``seed``.

    nanoGPT offsets its seed by the rank; hashing the three instead keeps every rank's stream, every
    purpose's stream and the run's own seed (which drew the initial weights) unrelated, so no rank
    replays the numbers its weights were initialised from.
    """
    digest = hashlib.blake2b(f"{seed}/{rank}/{stream}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")
