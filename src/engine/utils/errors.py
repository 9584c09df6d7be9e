"""User-facing errors: the entry points print these as one line and exit non-zero, without a traceback."""

from __future__ import annotations

import sys
from typing import NoReturn


class UserError(Exception):
    """Something the user can fix (config, data, checkpoint, environment). The message names the fix."""


class ConfigError(UserError):
    """An impossible or inconsistent configuration."""


class DataError(UserError):
    """Missing, unreadable or corrupt data files."""


class CheckpointError(UserError):
    """A checkpoint that does not exist, cannot be read, or belongs to another model."""


def user_error_cause(err: BaseException) -> UserError | None:
    """The UserError behind ``err``, also when Hydra's ``instantiate`` wrapped it in its own exception."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, UserError):
            return seen
        seen = seen.__cause__
    return None


def print_error(message: str) -> None:
    """The one printer of failures a user reads: ``error: <what is wrong>; fix: <how>`` on stderr."""
    print(f"error: {' '.join(message.split())}", file=sys.stderr, flush=True)  # one line, whatever a cause held


def exit_with_error(message: str, code: int = 2, printed: bool = True) -> NoReturn:
    """Print ``message`` (unless another rank says it: ``printed=False``) and exit with ``code``."""
    if printed:
        print_error(message)
    raise SystemExit(code)
