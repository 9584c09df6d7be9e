"""One Hydra job at a time: what a job changed in the process is undone when it ends.

Lightning's launcher leaves ``LOCAL_RANK``/``MASTER_PORT``/... in the parent's environment and the
process group alive. The next job of a multirun would then believe its processes were started
externally and wait for a rank that never comes. :func:`isolated_job` restores the environment and
tears the group down after each job.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from src.runtime.exit_cleanup import destroy_default_group


@contextlib.contextmanager
def isolated_job() -> Iterator[None]:
    """Restore ``os.environ`` and destroy the default process group when a job ends, whatever happened."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        destroy_default_group()
        os.environ.clear()
        os.environ.update(saved)
