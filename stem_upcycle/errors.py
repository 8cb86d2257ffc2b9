"""The one error type for mistakes a user can fix; the CLI prints its message as one line."""


class UserError(ValueError):
    """Bad input or environment: the message names the problem and the fix."""
