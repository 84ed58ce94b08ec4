"""The one error type a user can fix; a leaf, so that every layer can raise it."""


class ConfigError(ValueError):
    """A usage, config or data problem: one line, exit code 2, no traceback."""


class BadRow(ConfigError):
    """A row of the data that training cannot use (it names the row first): --skip-bad-samples leaves such rows
    out, check-data lists them all, and predict --file predicts them where it can."""
