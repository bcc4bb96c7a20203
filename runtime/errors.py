"""Errors the user can fix. The CLI turns these, and only these, into a one-line message and exit code 2."""


class UserError(ValueError):
    """Bad input: the message says what is wrong and how to fix it, on one line."""
