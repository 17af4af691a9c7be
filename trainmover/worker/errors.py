"""Errors a training script's misuse of the runtime raises (shared by the runtime and the
handles it gives the script)."""


class UsageError(RuntimeError):
    """The training script uses the runtime in a way that would lose or corrupt state."""


class DataNotDeterministic(UsageError):
    """A step's batch differs from another run of that step (a standby's, or the rehearsal's
    first attempt): the script's data is not a pure function of the step, so a joiner or a
    redone step would train on other samples."""
