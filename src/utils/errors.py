"""User-facing errors: the entry points print these as one line and exit non-zero, without a traceback."""


class UserError(Exception):
    """Something the user can fix (config, data, checkpoint, environment). The message names the fix."""


class ConfigError(UserError):
    """An impossible or inconsistent configuration."""


class DataError(UserError):
    """Missing, unreadable or corrupt data files."""


class CheckpointError(UserError):
    """A checkpoint that does not exist, cannot be read, or belongs to another model."""
