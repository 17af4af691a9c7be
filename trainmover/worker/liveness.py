"""A worker's side of failure handling: liveness, the step commit vote, aborting a step.

- ``Heartbeat``: a daemon thread (own store client) bumps ``hb/<worker>/<pid>`` every
  interval. A process that is stopped (SIGSTOP) or wedged stops beating; the controller
  fences it.
- ``AbortWatcher``: a daemon thread blocks on ``abort/<epoch>``; when the controller writes it,
  the worker's ``AbortSignal`` fires: the step in flight is doomed (``comm/groups.py``), and
  any wait outside a step raises ``StepAborted``.
- ``CommitVote``: no step is ever half-applied. After a step's collectives (gradients, norm,
  loss) and before the optimizer touches anything, every worker adds its vote; the last voter
  writes ``commit`` with a compare-and-set; the controller, on a failure, writes ``abort``
  the same way. Whichever lands first is the decision, recorded in one place.
"""
from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

from trainmover.core import protocol as P
from trainmover.comm.groups import AbortSignal, CommError, StepAborted, StoreClients


class Heartbeat:
    def __init__(self, stores: StoreClients, worker: str, interval_s: float):
        self.worker, self.interval_s = worker, interval_s
        self._stores = stores
        threading.Thread(target=self._loop, name=f"heartbeat-{worker}", daemon=True).start()

    def _loop(self) -> None:
        store = self._stores.get()
        while True:
            try:
                store.add(P.heartbeat_key(self.worker, os.getpid()), 1)
            except Exception:  # noqa: BLE001 - the store is gone: the job is over
                return
            time.sleep(self.interval_s)


class AbortWatcher:
    """Fires ``signal`` when the controller aborts the current epoch's step."""

    def __init__(self, stores: StoreClients, signal: AbortSignal, epoch: int):
        self.signal = signal
        self._stores = stores
        self.epoch = epoch
        self._thread = threading.Thread(target=self._loop, args=(epoch,), daemon=True,
                                        name=f"abort-watch-{epoch}")
        self._thread.start()

    def _loop(self, epoch: int) -> None:
        store = self._stores.get()
        key = P.abort_key(epoch)
        while True:
            try:
                store.wait([key], timedelta(seconds=P.IDLE_WAIT_S))
                reason = store.get(key).decode()
            except Exception:  # noqa: BLE001 - long idle wait, or the store is gone
                try:
                    store.check([key])
                except Exception:  # noqa: BLE001
                    return
                continue
            self.signal.set(f"epoch {epoch} aborted: {reason}")
            return


class CommitVote:
    """The step's commit decision (see module doc). Costs each worker two or three store
    round trips per step; ``votes`` counts voters of the current epoch only."""

    def __init__(self, stores: StoreClients, num_voters: int, epoch: int,
                 reporter: str | None = None):
        self.store = stores.get()
        self.num_voters, self.epoch = num_voters, epoch
        self.reporter = reporter  # set on the worker whose metrics record the step

    def __call__(self, step: int, info: dict) -> bool:
        if self.reporter is not None:
            # kept with the vote, so a committed step's record survives its reporter dying
            # between the decision and writing metrics.jsonl (the controller backfills it)
            self.store.set(P.commit_key(self.epoch, step, "metrics"),
                           P.encode({"step": step, **info, "worker": self.reporter}))
        votes = self.store.add(P.commit_key(self.epoch, step, "votes"), 1)
        decision = P.commit_key(self.epoch, step, "decision")
        if votes == self.num_voters:
            self.store.compare_set(decision, "", "commit")
        self.store.wait([decision])
        return self.store.get(decision) == b"commit"


def is_step_failure(exc: BaseException, signal: AbortSignal) -> bool:
    """Errors that mean "this step (or this recovery) cannot finish": a failed operation or
    an abort, anywhere in the exception's chain, or while the job's abort signal is set."""
    seen = exc
    while seen is not None:
        if isinstance(seen, (StepAborted, CommError)):
            return True
        seen = seen.__cause__ or seen.__context__
    return signal.is_set()
