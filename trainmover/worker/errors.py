"""Errors a training script's misuse of the runtime raises (shared by the runtime and the
handles it gives the script)."""


class UsageError(RuntimeError):
    """The training script uses the runtime in a way that would lose or corrupt state."""
