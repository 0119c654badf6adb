"""The one exception type for user mistakes: the CLI prints it as a single line, exit code 2."""


class ConfigError(ValueError):
    """A user-facing mistake (bad config value, missing dataset, ...): the message is one line."""
