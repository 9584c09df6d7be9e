"""User-facing errors: the entry points print these as one line and exit non-zero, without a traceback."""


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
