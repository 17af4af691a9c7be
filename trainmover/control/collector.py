"""The controller's garbage collector, at the sizes where its pauses are round times.

CPython's full collection walks every object the collector tracks; it runs when the objects
that survived into the oldest generation since the last one reach a quarter of those there.
At 16K workers the controller holds hundreds of thousands of long-lived objects (the layout,
the membership and process tables, the straggler feed's newest windows), at about 0.6 us
each on this machine: a full collection was a 0.1-0.6 s pause of whichever thread triggered
it, the supervision round included, and a window of step measurements coming in triggered
one or two (``benchmarks/straggler_feed.py``).

Two measures, neither a change of what is freed (reference counting frees every object that
is in no cycle as before; only cycles wait for a collection):
- ``settle``: once the controller's start-up state is built, a collection, then
  ``gc.freeze()``: what exists then is never walked again. Only a job's own controller
  process does it (``Coordinator.run(own_process=True)``), not one embedded in a test run or
  an application, whose objects it would keep out of every later collection too.
- ``paused``: the straggler feed takes a window in (thousands of decoded messages that die
  at its end) with automatic collections off, so none of them walks the window's transient
  objects; the next one, after, sees only what survived.
"""
from __future__ import annotations

import contextlib
import gc
import threading

_lock = threading.Lock()
_holders = 0                 # blocks inside ``paused`` now, in any thread
_was_enabled = False         # whether collections were on when the first of them began


def settle() -> None:
    """Collect, then keep every object that exists now out of later collections."""
    gc.collect()
    gc.freeze()


def release() -> None:
    """Undo ``settle`` (a process that ran a controller and goes on to something else)."""
    gc.unfreeze()


@contextlib.contextmanager
def paused():
    """Automatic collections off for the block (nested or in several threads: back on when
    the last block ends, and only if they were on when the first began)."""
    global _holders, _was_enabled
    with _lock:
        if _holders == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _holders += 1
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0 and _was_enabled:
                gc.enable()
