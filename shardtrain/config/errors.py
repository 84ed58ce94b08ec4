"""The one error type a user can fix; a leaf, so that every layer can raise it."""


class ConfigError(ValueError):
    """A usage, config or data problem: one line, exit code 2, no traceback."""
