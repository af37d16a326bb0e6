"""The one exception type users see: the CLI prints its message and exits non-zero, without a traceback."""


class DsmtError(Exception):
    """An error with an actionable message: the rule broken, the values seen, and the fix."""

    exit_code = 2
