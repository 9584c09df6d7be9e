"""One Hydra job at a time: what a job changed in the process is undone when it ends.

Lightning's launcher leaves ``LOCAL_RANK``/``MASTER_PORT``/... in the parent's environment and the
process group alive. The next job of a multirun would then believe its processes were started
externally and wait for a rank that never comes. :func:`isolated_job` restores the environment and
tears the group down after each job.

:func:`entry_command` is how this Hydra app is started again in another process: by a child rank that
joins one job, and by a worker process of a parallel search.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

from src.engine.runtime.exit_cleanup import destroy_default_group

# Set once by a service that lives as long as the process, and needed by every later job: wandb starts
# its service in the first job's wandb.init and later inits attach to it through this variable.
KEPT_ACROSS_JOBS = ("WANDB_SERVICE",)


@contextlib.contextmanager
def isolated_job() -> Iterator[None]:
    """Restore ``os.environ`` (but :data:`KEPT_ACROSS_JOBS`) and destroy the default process group when a job
    ends, whatever happened."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        destroy_default_group()
        kept = {name: os.environ[name] for name in KEPT_ACROSS_JOBS if name in os.environ}
        os.environ.clear()
        os.environ.update(saved)
        os.environ.update(kept)


def entry_command(hc: Any) -> list[str]:
    """The interpreter, script (or ``-m`` module), config path and config name of this Hydra app.

    ``hc`` is the ``hydra`` node of the running config. A child rank (``child_command``) and a search's worker
    process (``src/engine/search/sweeper.py``) add their overrides to it.
    """
    from hydra.utils import to_absolute_path

    import __main__

    if __main__.__spec__ is None:
        command = [sys.executable, to_absolute_path(sys.argv[0])]
    else:
        command = [sys.executable, "-m", __main__.__spec__.name]
    main_source = next((s for s in hc.runtime.config_sources if s.provider == "main"), None)
    if main_source is not None and main_source.path.startswith("file://"):
        command.append(f"--config-path={main_source.path.removeprefix('file://')}")
    command.append(f"--config-name={hc.job.config_name}")
    return command
