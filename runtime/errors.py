"""Errors the user can fix. The CLI turns these, and only these, into a one-line message and exit code 2."""

import errno

UNWRITABLE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})
"""Filesystem errors that a retry meets again: a full disk or quota, a read-only filesystem, no permission."""


class UserError(ValueError):
    """Bad input: the message says what is wrong and how to fix it, on one line."""


class JobError(RuntimeError):
    """A training job failed for a reason that a restart would meet again (a diverged loss, a peer that never
    answered): the message is one line, and the job stops instead of being retried."""


def unwritable(exc: BaseException | None) -> OSError | None:
    """The filesystem error that a retry meets again (UNWRITABLE) that `exc` is, or was raised from; else None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError) and exc.errno in UNWRITABLE:
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def os_reason(exc: OSError) -> str:
    """`REASON: PATH` of a filesystem error (`No space left on device: /runs/a/metrics.jsonl`), for one-line
    messages; the reason alone when the error names no file."""
    reason = exc.strerror or str(exc)
    return f"{reason}: {exc.filename}" if exc.filename else reason
