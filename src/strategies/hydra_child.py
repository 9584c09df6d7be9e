"""The command that starts child rank ``k`` of the current Hydra job, for Lightning's popen launcher.

Stock Lightning re-runs the parent's ``sys.argv``. In a multirun that argv is the whole sweep
(``-m lr=0.01,0.1``), so each child would replay every job in directories of its own. This
command replays *this job*: its config name, its resolved overrides and its output directory,
so every rank of a job logs into the same run dir and only the parent writes ``.hydra/``.
"""

from __future__ import annotations

import sys

# Hydra overrides that describe the parent's sweep, not the job a child must join.
_PARENT_ONLY = ("hydra.mode", "hydra.run.", "hydra.sweep.", "hydra.job.", "hydra.output_subdir",
                "hydra/sweeper", "hydra/launcher", "hydra.sweeper", "hydra.launcher")


def child_command(local_rank: int) -> tuple[list[str], str]:
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
        "hydra.mode=RUN",  # a search config may switch to multirun itself: a rank joins one job, never a sweep
    ]
    return command, get_original_cwd()
