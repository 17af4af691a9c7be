"""The host's agent as the watcher of the controller's aborts for its processes.

Why: every worker used to wait for ``abort/<epoch>`` in the store itself, a connection
each held open for it, and a controller's abort woke one waiter a worker in the store's one
thread: at 16K workers, 16K answers on the path from a crash to its recovery. Here a
process asks its agent on its channel (``w <epoch>``); the agent waits for that key once
for the host, with a client of its own per epoch watched, and relays the abort (``a <epoch>
<reason>``) on the channels of the processes that asked. The store holds one wait a host,
and an abort wakes one waiter a host.

What it keeps from the worker's own watch (``worker/liveness.AbortWatcher``): only the
controller's signed value is an abort (a forged one is waited past, the genuine one
overwrites it), and an abort is told to a process that asks after it came. An epoch's
watch ends when it fired, or when none of the host's processes still asks for it (each asks
for one epoch at a time: asking for a later one, or exiting, ends its interest).
"""
from __future__ import annotations

import collections
import threading
import time
from datetime import timedelta
from typing import Callable

from trainmover.agent.votes import send_on
from trainmover.core import protocol as P

# How long an epoch's watcher sleeps while a forged value sits at its key (the genuine
# abort overwrites it; ``wait`` would return at once meanwhile).
FORGED_POLL_S = 0.05
# How often an epoch's watcher looks whether anyone still asks for it (a later epoch or an
# exit ends a process's interest without writing the key). Not often: every re-armed wait
# is two store requests a host (at 2K hosts every 5 s, 800 a second), and an epoch ends by
# its abort in practice (a recovery moves every process on only after aborting it), so a
# watch nobody wants is rare and costs one idle connection until then.
IDLE_CHECK_S = P.IDLE_WAIT_S
# How often an abort is offered again to a process whose channel is full (it is stopped,
# or its reader is behind): until it takes it or exits.
RESEND_S = 0.01
ABORTS_KEPT = 64             # fired epochs remembered for a process that asks late


class AbortRelay:
    """``watch`` (from the channels' reader) and ``forget`` (an exited process); one
    thread per epoch being watched. ``connect`` makes a new authenticated store client."""

    def __init__(self, connect: Callable[[], object]):
        self._connect = connect
        self._lock = threading.Lock()
        self._watchers: dict[int, dict[str, object]] = {}    # epoch -> name -> its record
        self._asked: dict[str, int] = {}                     # name -> the epoch it watches
        self._aborted: collections.OrderedDict[int, str] = collections.OrderedDict()
        self.error: BaseException | None = None              # the store is gone
        # called with each epoch whose abort fired (the host's report relay times its
        # silent processes from it: ``agent/reports.py``)
        self.on_fired: Callable[[int], None] | None = None

    def watch(self, child, epoch: int) -> None:
        with self._lock:
            reason = self._aborted.get(epoch)
            if reason is None:
                before = self._asked.get(child.name)
                if before is not None and before != epoch:
                    self._watchers.get(before, {}).pop(child.name, None)
                self._asked[child.name] = epoch
                watchers = self._watchers.get(epoch)
                if watchers is None:
                    watchers = self._watchers[epoch] = {}
                    threading.Thread(target=self._watch, args=(epoch,), daemon=True,
                                     name=f"abort-relay-{epoch}").start()
                watchers[child.name] = child
                return
        # fired already: told now, or offered again from a thread of its own while the
        # channel is full (this is the channels' reader: it must not wait)
        message = P.abort_message(epoch, reason)
        if send_on(child, message) == "later":
            threading.Thread(target=self._tell, args=([child], message), daemon=True,
                             name=f"abort-late-{epoch}").start()

    def forget(self, name: str) -> None:
        with self._lock:
            epoch = self._asked.pop(name, None)
            if epoch is not None:
                self._watchers.get(epoch, {}).pop(name, None)

    def _wanted(self, epoch: int) -> bool:
        """Whether anyone still asks for ``epoch``; if not, its watch ends here (a later ask
        starts another)."""
        with self._lock:
            if self._watchers.get(epoch):
                return True
            self._watchers.pop(epoch, None)
            return False

    def _watch(self, epoch: int) -> None:
        store = None
        try:
            store = self._connect()
            key = P.abort_key(epoch)
            while True:
                try:
                    store.wait([key], timedelta(seconds=IDLE_CHECK_S))
                except Exception:  # noqa: BLE001 - a timeout (of its client's kind), or gone
                    store.check([key])             # raises if the store is gone
                    if not self._wanted(epoch):
                        return
                    continue
                reason = store.valid(key)
                if reason is not None:
                    break
                time.sleep(FORGED_POLL_S)
        except Exception as exc:  # noqa: BLE001 - the store is gone: the agent learns of it
            self.error = exc
            return
        finally:
            if store is not None:
                store.raw.close()
        with self._lock:
            self._aborted[epoch] = text = reason.decode(errors="replace")
            while len(self._aborted) > ABORTS_KEPT:
                self._aborted.popitem(last=False)
            children = list(self._watchers.pop(epoch, {}).values())
        if self.on_fired is not None:
            self.on_fired(epoch)
        self._tell(children, P.abort_message(epoch, text))

    @staticmethod
    def _tell(children: list, message: bytes) -> None:
        while children:
            # offered again while a channel is full (exited or closed: done)
            children = [c for c in children if send_on(c, message) == "later"]
            if children:
                time.sleep(RESEND_S)
