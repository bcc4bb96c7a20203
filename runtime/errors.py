"""Errors the user can fix. The CLI turns these, and only these, into a one-line message and exit code 2."""


class UserError(ValueError):
    """Bad input: the message says what is wrong and how to fix it, on one line."""


class JobError(RuntimeError):
    """A training job failed for a reason that a restart would meet again (a diverged loss, a peer that never
    answered): the message is one line, and the job stops instead of being retried."""
