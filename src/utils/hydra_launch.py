"""Make Lightning's DDP subprocess launcher correct under Hydra, including multirun sweeps.

Two things go wrong with stock Lightning (see Lightning PR 18175, ashleve#393):

1. Each child rank is started with the parent's ``sys.argv``. In a multirun that argv is
   the whole sweep (``-m lr=0.01,0.1``), so rank 1 replays every job of the sweep in its
   own timestamped directories. :func:`hydra_child_command` instead replays *this job*:
   its config name, its resolved overrides, and its output directory.
2. The launcher leaves ``LOCAL_RANK``/``MASTER_PORT``/... in the parent's environment and
   the process group alive. The next job of a sweep then believes its processes were
   created externally and waits forever for a rank that never comes.
   :func:`isolated_job` restores the environment and tears the group down after each job.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

from src.strategies.exit_cleanup import destroy_default_group

# Hydra overrides that describe the parent's sweep, not the job a child must join.
_PARENT_ONLY = ("hydra.mode", "hydra.run.", "hydra.sweep.", "hydra.job.", "hydra.output_subdir",
                "hydra/sweeper", "hydra/launcher", "hydra.sweeper", "hydra.launcher")


def hydra_child_command(local_rank: int) -> tuple[list[str], str]:
    """Command and cwd that start rank ``local_rank`` of the current Hydra job (run or multirun)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import get_original_cwd, to_absolute_path

    import __main__

    hc = HydraConfig.get()
    if __main__.__spec__ is None:
        command = [sys.executable, to_absolute_path(sys.argv[0])]
    else:
        command = [sys.executable, "-m", __main__.__spec__.name]
    main_source = next((s for s in hc.runtime.config_sources if s.provider == "main"), None)
    if main_source is not None and main_source.path.startswith("file://"):
        command.append(f"--config-path={main_source.path.removeprefix('file://')}")
    command.append(f"--config-name={hc.job.config_name}")
    command += [o for o in hc.overrides.hydra if not o.lstrip("~+").startswith(_PARENT_ONLY)]
    command += list(hc.overrides.task)
    command += [
        f'hydra.run.dir="{hc.runtime.output_dir}"',
        f"hydra.job.name={hc.job.name}",  # same name -> same log file, each line tagged with its rank
        "hydra.output_subdir=null",  # only the parent writes .hydra/
    ]
    return command, get_original_cwd()


def patch_lightning_launcher() -> None:
    """Route Lightning's Hydra child command through :func:`hydra_child_command` (idempotent)."""
    from lightning.pytorch.strategies.launchers import subprocess_script

    subprocess_script._hydra_subprocess_cmd = hydra_child_command


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
