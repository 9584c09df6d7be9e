"""Helpers around the train/eval task functions: error reporting, extras, metric lookup."""

from __future__ import annotations

import functools
import os
import re
import sys
import warnings
from collections.abc import Callable
from typing import Any

from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig

from src.engine.run.directory import discard_refused_run_dir
from src.engine.runtime.exit_cleanup import exit_after_peer_failure, peer_failed
from src.engine.runtime.sigterm import stop_exit_code
from src.engine.utils.errors import ConfigError, UserError, exit_with_error, user_error_cause
from src.engine.utils.pylogger import RankedLogger, current_rank
from src.engine.utils.rich_utils import print_config_tree

log = RankedLogger(__name__)


def task_wrapper(
    task: Callable[[DictConfig], tuple[dict, dict]],
) -> Callable[[DictConfig], tuple[dict, dict]]:
    """Run a task; always log the output dir and close loggers; turn a :class:`UserError` into one line + exit 2.

    Exiting (rather than raising) keeps Hydra from printing a traceback around an error
    the user can fix from its message alone.
    """

    @functools.wraps(task)
    def wrapped(cfg: DictConfig) -> tuple[dict, dict]:
        try:
            return reported(task, cfg)
        except SystemExit as exit_:
            if exit_.code == 2:  # refused (bad input): nothing was saved, so no run dir is left behind
                discard_refused_run_dir()
            raise
        finally:
            if os.path.isdir(cfg.paths.output_dir):  # a refused run's is gone
                log.info(f"Output dir: {cfg.paths.output_dir}")
            _finish_wandb()

    return wrapped


def reported(task: Callable[[DictConfig], tuple[dict, dict]], cfg: DictConfig) -> tuple[dict, dict]:
    """``task(cfg)``, its errors turned into exits: a user's error one line and 2, a stop its signal's code."""
    try:
        return task(cfg)
    except SIGTERMException as err:
        if err.code is None:  # Lightning's own stop (validate/test): a stopped job must not look successful
            raise SystemExit(stop_exit_code(err)) from None
        if getattr(err, "requeued", False):  # no result for Hydra or submitit: the requeued job gives it
            raise SystemExit(err.code) from None
        raise
    except Exception as err:
        cause = user_error_cause(err) or rendezvous_error(err)
        if cause is not None:
            exit_with_error(str(cause))
        if peer_failed(err):  # another rank failed first and says why: stop quietly
            exit_after_peer_failure(current_rank())
        raise


_STORE_TIMEOUT = re.compile(r"timed out after (\d+)ms while trying to connect to \(([^,]+), (\d+)\)")


def rendezvous_error(err: BaseException) -> UserError | None:
    """torch's store client gave up reaching MASTER_ADDR:MASTER_PORT (a launcher that skips the pre-flight's
    bounded wait, e.g. torchrun or srun): the same one line, instead of C++ frames."""
    seen: BaseException | None = err
    while seen is not None:
        found = _STORE_TIMEOUT.search(str(seen))
        if found:
            ms, addr, port = found.groups()
            return UserError(
                f"could not reach the rendezvous at MASTER_ADDR:MASTER_PORT={addr}:{port} within {int(ms) / 1000:g} s; "
                "fix: start rank 0 (node 0) with the same MASTER_ADDR and MASTER_PORT, and check that address and "
                "that the port is open between the machines"
            )
        seen = seen.__cause__
    return None


def _finish_wandb() -> None:
    """wandb keeps a background process that would hang a failed multirun; close it if it was imported."""
    wandb = sys.modules.get("wandb")
    if wandb is not None and getattr(wandb, "run", None) is not None:
        wandb.finish()


def extras(cfg: DictConfig) -> None:
    """Optional conveniences from ``cfg.extras``: silence warnings, print the config tree."""
    opts = cfg.get("extras")
    if not opts:
        return
    if opts.get("ignore_warnings"):
        warnings.filterwarnings("ignore")
    if opts.get("print_config"):
        print_config_tree(cfg, save_to_file=True)


def get_metric_value(metric_dict: dict[str, Any], metric_name: str | None) -> float | None:
    """The value a sweep optimizes; a clear error when the metric was never logged."""
    if not metric_name:
        return None
    if metric_name not in metric_dict:
        raise ConfigError(
            f"optimized_metric={metric_name!r} was not logged; fix: set optimized_metric to one of {sorted(metric_dict)}"
        )
    value = metric_dict[metric_name]
    return float(value.item() if hasattr(value, "item") else value)
