"""Hydra's own errors as one line and exit 2, like every other bad input.

Hydra prints a config error (an unknown option ``trainer=nope``, a mistyped key ``trainer.max_epoch=3``,
bad override syntax) as several lines plus a hint about ``HYDRA_FULL_ERROR`` and exits 1, the code of a
crash. :func:`hydra_main` is ``hydra.main`` with two wrappers:

* around the entry (Hydra's composition): Hydra is told to raise (``HYDRA_FULL_ERROR=1`` in this
  process), and its config errors become ``error: <what is wrong>; fix: <how>`` and exit 2;
* around the job: a :class:`~src.engine.utils.errors.UserError` raised outside ``task_wrapper`` and a config
  value the job needs but was never given (``???``, an unset ``${oc.env:...}``) get the same one line,
  without Hydra's ``Error executing job`` line.

Anything else is a bug and keeps its full traceback (exit 1). A user who sets ``HYDRA_FULL_ERROR=1``
gets Hydra's own behaviour: full traces of config errors too. Child ranks re-run the same command and
inherit the variable; a marker tells them it was set here, not by the user.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import os
import re
import sys
from collections.abc import Callable
from typing import Any

import hydra
from hydra.errors import CompactHydraException, HydraException, MissingConfigException, OverrideParseException
from omegaconf.errors import (
    InterpolationResolutionError,
    MissingMandatoryValue,
    OmegaConfBaseException,
)

from src.engine.runtime.launch_context import launch_context
from src.engine.utils.errors import exit_with_error, user_error_cause

FULL_ERROR = "HYDRA_FULL_ERROR"
_SET_HERE = "SRC_HYDRA_FULL_ERROR_SET_BY_ENTRY"  # FULL_ERROR was set by this module, not by the user
_IN_JOB = "_src_raised_in_job"  # attribute on an exception that left the job function (a bug)


def user_wants_full_trace() -> bool:
    """True when the user set ``HYDRA_FULL_ERROR=1`` (not inherited from a parent run of this module)."""
    return os.environ.get(FULL_ERROR) == "1" and os.environ.get(_SET_HERE) != "1"


def hydra_main(**kwargs: Any) -> Callable[[Callable], Callable]:
    """``hydra.main(**kwargs)`` whose bad-input errors (config, overrides, UserError) are one line + exit 2."""

    def decorate(task: Callable) -> Callable:
        return report_config_errors(hydra.main(**kwargs)(report_job_errors(task)))

    return decorate


def _exit_with(message: str, every_rank_sees_it: bool = False) -> None:
    """Print ``error: message`` and exit 2; an error every rank of a torchrun/srun launch sees alike (the
    command line's) is printed by global rank 0 only, the others exit 2 quietly."""
    exit_with_error(message, printed=not every_rank_sees_it or launch_context().is_global_zero)


def report_job_errors(task: Callable) -> Callable:
    """Inside the job: a UserError or a missing config value -> one line + exit 2; a bug -> marked, re-raised."""

    @functools.wraps(task)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if user_wants_full_trace():
            return task(*args, **kwargs)
        try:
            return task(*args, **kwargs)
        except Exception as err:
            message = job_error_message(err)
            if message is None:
                with contextlib.suppress(
                    AttributeError
                ):  # the entry wrapper then leaves it alone: a traceback
                    setattr(err, _IN_JOB, True)
                raise
        _exit_with(message)

    return wrapped


def report_config_errors(main: Callable) -> Callable:
    """Around ``hydra.main``'s function: Hydra raises instead of printing; its config errors become one line."""

    @functools.wraps(main)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if user_wants_full_trace():
            return main(*args, **kwargs)
        saved = {name: os.environ.get(name) for name in (FULL_ERROR, _SET_HERE)}
        os.environ[FULL_ERROR] = os.environ[_SET_HERE] = "1"
        try:
            return main(*args, **kwargs)
        except Exception as err:
            if getattr(err, _IN_JOB, False):  # no bad input: Hydra's compact message or the whole traceback
                if not isinstance(err, CompactHydraException):
                    raise
                _print_compact(err)
                raise SystemExit(1) from None
            message = config_error_message(err)
            if message is None:
                raise
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        _exit_with(message, every_rank_sees_it=True)

    return wrapped


def _print_compact(err: CompactHydraException) -> None:
    """Print one of Hydra's own job errors (e.g. a ``_target_`` that cannot be built) as Hydra does."""
    sys.stderr.write(str(err) + os.linesep)
    if isinstance(err.__cause__, OmegaConfBaseException):
        sys.stderr.write(str(err.__cause__) + os.linesep)
    sys.stderr.flush()


# -- messages ------------------------------------------------------------------------------------------
def job_error_message(err: BaseException) -> str | None:
    """The one line for an error raised by the job, or None when it is a bug (traceback)."""
    cause = user_error_cause(err)
    if cause is not None:
        return str(cause)
    if isinstance(err, MissingMandatoryValue):
        key = err.full_key or err.key or "a config value"
        return f"{key} is required but not set (it is ??? in the config); fix: pass it, e.g. {key}=<value>"
    if isinstance(err, InterpolationResolutionError):
        return _interpolation_message(err)
    return None


def config_error_message(err: BaseException) -> str | None:
    """The one line for an error Hydra raised while composing the config, or None when it is no config error."""
    cause = user_error_cause(err)
    if cause is not None:
        return str(cause)
    if isinstance(err, OverrideParseException):
        return _override_syntax_message(err)
    if isinstance(err, MissingConfigException):
        return _missing_config_message(err)
    if isinstance(err, HydraException | OmegaConfBaseException):
        return _composition_message(err)
    return None


_OMEGACONF_DETAIL = ("full_key:", "object_type=", "reference_type=")


def _lines(err: BaseException) -> list[str]:
    """The message's lines without OmegaConf's ``full_key:``/``object_type=`` details."""
    lines = (line.strip() for line in str(err).splitlines())
    return [line for line in lines if line and not line.startswith(_OMEGACONF_DETAIL)]


def _interpolation_message(err: InterpolationResolutionError) -> str:
    what = _lines(err)[0] if _lines(err) else type(err).__name__
    where = f" in {err.full_key}" if err.full_key else ""
    if "Environment variable" in what:
        return f"{what}{where}; fix: export that variable, or override {err.full_key or 'the key'} on the command line"
    return f"cannot resolve an interpolation{where}: {what}; fix: correct the ${{...}} it refers to"


def _override_syntax_message(err: OverrideParseException) -> str:
    bad = _bad_override()
    what = _lines(err)[0] if _lines(err) else "cannot parse an override"
    subject = f"cannot parse the override {bad!r}" if bad else "cannot parse an override"
    return (
        f"{subject} ({what}); fix: write key=value (+key=value adds a key, ~key removes one), and quote "
        "values with spaces or brackets, e.g. 'key=[1,2]' (https://hydra.cc/docs/advanced/override_grammar/basic)"
    )


def _bad_override() -> str | None:
    """The first command-line override Hydra's grammar rejects (the exception does not say which)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for arg in sys.argv[1:]:
        if arg.startswith("-"):
            continue
        try:
            parser.parse_override(arg)
        except Exception:  # the grammar's own errors, whatever their type
            return arg
    return None


def _missing_config_message(err: MissingConfigException) -> str:
    missing = err.missing_cfg_file or "?"
    options = list(err.options or [])
    if "/" in missing and options:
        group, name = missing.rsplit("/", 1)
        close = difflib.get_close_matches(name, options, n=1)
        hint = f"did you mean {group}={close[0]}? " if close else ""
        return (
            f"{group}={name} is not a config of group '{group}'; fix: {hint}choose one of "
            f"{', '.join(options)} ({group}=<option>)"
        )
    first = _lines(err)[0] if _lines(err) else f"config {missing!r} not found"
    return f"{first.rstrip('.')}; fix: check the name, and that it is under configs/ (--config-name=train or eval)"


def _composition_message(err: BaseException) -> str:
    lines = _lines(err)
    first = lines[0].rstrip(".") if lines else type(err).__name__
    rest = [line.rstrip(".") for line in lines[1:]]
    cause = err.__cause__
    overridden = re.match(r"Could not override '(.+)'", first)
    if overridden and isinstance(cause, OmegaConfBaseException) and "not in struct" in str(cause):
        key = overridden.group(1)
        close = _close_keys(cause)
        hint = f"did you mean {close}? " if close else ""
        append = next((line.split(" use ", 1)[1] for line in rest if " use +" in line), f"+{key}=...")
        return (
            f"{key} is not a key of the config ({first}); fix: {hint}check the spelling, or prefix it with + "
            f"to add a new key: {append}"
        )
    if first.startswith("Could not delete"):
        return f"{first}; fix: remove that ~override, or check the key's spelling"
    key = getattr(err, "full_key", None)
    if key:
        first = f"{first} (in {key})"
    if rest:
        return f"{first}; fix: {'; '.join(rest)}"
    return f"{first}; fix: check the overrides on the command line (--help lists the config groups)"


def _close_keys(cause: OmegaConfBaseException) -> str | None:
    parent, key = getattr(cause, "parent_node", None), getattr(cause, "key", None)
    if parent is None or key is None or not hasattr(parent, "keys"):
        return None
    close = difflib.get_close_matches(str(key), [str(k) for k in parent], n=1)
    if not close:
        return None
    prefix = cause.full_key.rsplit(".", 1)[0] + "." if "." in (cause.full_key or "") else ""
    return prefix + close[0]
