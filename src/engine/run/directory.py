"""The run directory, chosen once per launch before Hydra writes anything (a Hydra callback).

``hydra.run.dir`` in ``configs/hydra/default.yaml`` is the runs root. Unless the command names
``hydra.run.dir`` itself (child ranks get their parent's dir that way), :meth:`RunDirectory.on_run_start`
asks :func:`src.engine.run.identity.choose_run_dir` for this launch's directory inside it and sets it, once. It
also refuses, in one line and before anything is written, a directory that cannot be created or that
holds checkpoints this run would not resume from. Each job's dir gets its run id (``.run_id``) here; the
``${run_uid:}`` resolver only reads it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, open_dict, read_write

from src.engine.checkpointing.start import check_no_earlier_checkpoints
from src.engine.run.identity import choose_run_dir, ensure_run_uid, passed_over_note, release_run_dirs
from src.engine.run.status import CHECKPOINT_DIR
from src.engine.runtime.launch_context import launch_context
from src.engine.utils.errors import ConfigError, exit_with_error
from src.engine.utils.pylogger import RankedLogger

log = RankedLogger(__name__)


def unwritable_reason(directory: Path) -> str | None:
    """Why ``directory`` cannot be created or written, or None when it can."""
    probe = directory.absolute()
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is a file, not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable"
    return None


def named_by_command(config: DictConfig) -> bool:
    """True when the command line sets ``hydra.run.dir`` (a user's choice, or a child rank's parent's dir)."""
    return any(o.split("=", 1)[0].lstrip("+~") == "hydra.run.dir" for o in config.hydra.overrides.hydra)


_created_here: Path | None = None  # the run dir this launch created (a refusal removes it again)


def discard_refused_run_dir() -> None:
    """Remove the run directory this launch created, when the run was refused before it saved anything: a
    refused run leaves no directory behind. A directory that existed before (a resume) is never touched."""
    global _created_here
    created, _created_here = _created_here, None
    if created is not None and created.is_dir() and not (created / CHECKPOINT_DIR).exists():
        shutil.rmtree(created, ignore_errors=True)


class RunDirectory(Callback):
    """Choose, check and claim the run directory; release it when the run ends.

    Other ranks of a launch (torchrun, srun) exit 2 quietly on a refusal: global rank 0 says why.
    """

    _note: str | None = None  # why the run dir is new though the same command has an unfinished run

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        given = Path(config.hydra.run.dir)
        self._refuse_unwritable(given)
        if not named_by_command(config):
            chosen = choose_run_dir(given, list(config.hydra.overrides.task), bool(config.get("auto_resume", False)))
            with read_write(config), open_dict(config):
                config.hydra.run.dir = str(chosen)
            given = chosen
            self._note = passed_over_note(chosen)  # said once the job's logging is set up (on_job_start)
        try:
            check_no_earlier_checkpoints(config, given)
        except ConfigError as err:
            exit_with_error(str(err), printed=launch_context().is_global_zero)
        global _created_here  # a new dir (choose_run_dir may have made it) has no run id yet; a resumed one has
        _created_here = None if (given / ".run_id").exists() else given.absolute()

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._refuse_unwritable(Path(config.hydra.sweep.dir))

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        ensure_run_uid(config.hydra.runtime.output_dir)
        note, self._note = self._note, None
        if note:
            log.warning(note)

    def on_run_end(self, config: DictConfig, **kwargs: Any) -> None:
        release_run_dirs()

    @staticmethod
    def _refuse_unwritable(directory: Path) -> None:
        reason = unwritable_reason(directory)
        if reason:
            exit_with_error(f"cannot create output dir {directory}: {reason}; fix: choose another with "
                            "hydra.run.dir=... (or paths.log_dir=...)", printed=launch_context().is_global_zero)
