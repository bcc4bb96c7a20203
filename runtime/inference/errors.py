"""The error inference raises for bad input (checkpoint, prompt, offload mode, ring size): its message is one line,
which the CLI prints before exiting 2. A leaf module, so that every inference module can raise it without importing
the checkpoint reader."""

from runtime.errors import UserError


class InferError(UserError):
    """Bad inference input; the message is one line."""
