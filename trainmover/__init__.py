"""trainmover: keeps distributed PyTorch training running through interruptions.

A training script's whole contact with the runtime::

    import trainmover
    rt = trainmover.init()
    model = rt.data_parallel(model)
    rt.register(model=model, optimizer=optimizer)
    for step in rt.steps(total):
        ...
        if rt.commit(loss=loss.item()):
            optimizer.step()

See ``trainmover.worker.runtime`` for the API and ``examples/`` for whole scripts. Importing
this package imports no torch; ``init`` does.
"""
from __future__ import annotations

__version__ = "0.2.0"


def init():
    """This worker's runtime (``trainmover.worker.runtime.Runtime``)."""
    from trainmover.worker.runtime import init as _init

    return _init()


__all__ = ["init"]
