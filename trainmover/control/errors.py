"""How a job ends other than by finishing."""
from __future__ import annotations


class JobFailed(RuntimeError):
    """The job stopped: a failure it cannot recover from, or a misuse of the runtime by the
    training script. Committed progress and checkpoints are left intact."""


class Superseded(RuntimeError):
    """Another controller took over this job (``trainmover controller --resume --force``)."""
