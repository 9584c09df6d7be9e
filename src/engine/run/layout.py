"""Where a run's files go inside its run dir: names that the run-status record and the checkpoint callbacks share
(a module of constants, so both can use them without importing each other)."""

from __future__ import annotations

from pathlib import Path

CHECKPOINT_DIR = "checkpoints"  # <run dir>/checkpoints: every fit of the run saves there
LAST_CHECKPOINT = Path(CHECKPOINT_DIR) / "last.ckpt"  # a file, or trainer=fsdp's folder of shards
