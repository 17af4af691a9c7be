"""What an agent hears from the store, each from a thread that waits for it there instead of
a loop that asks every few milliseconds: with thousands of hosts, an agent looking for a
request every 20 ms and for its fencing every 100 ms was 60 store requests a second each,
most of the job's store load (``trainmover bench control``). A wait costs the store nothing
until its key is written.

- ``RequestFeed``: the controller's requests to this host (``agent/<node>/req/<n>``, a
  numbered queue read as ``core/queues.SlotReader`` reads one: a forged head is not
  consumed, a hole is skipped), handed to the agent's loop through a queue;
- ``FenceWatch``: the controller's word that this host was declared lost.

Each wakes the agent's loop (``wake``) when it has something. Each has its own store
client: a client's blocking wait would hold any other request behind it.
"""
from __future__ import annotations

import queue
import threading
import time
from datetime import timedelta
from typing import Callable

from trainmover.core import protocol as P
from trainmover.core.kvstore import StoreTimeout
from trainmover.core.queues import SlotReader, drain, take_or_wait

# How long a reader sleeps while a forged value sits where it waits (the genuine writer
# overwrites it; ``wait`` would return at once meanwhile).
FORGED_POLL_S = 0.05


class RequestFeed:
    """Reads this host's requests as they are written; ``poll`` hands over the decoded ones
    (and, as ``(key, error)``, the ones refused). A queue with a hole is looked at again
    every ``recheck_s`` (the hole is skipped after the reader's hole timeout)."""

    def __init__(self, store, node: int, recheck_s: float, wake: Callable[[], None],
                 on_reject: Callable[[str, str], None]):
        self.store, self.node, self.recheck_s = store, node, recheck_s
        self.wake, self.on_reject = wake, on_reject
        self.queue: queue.Queue = queue.Queue()
        self.error: BaseException | None = None       # the store is gone
        self._thread = threading.Thread(target=self._loop, name=f"requests-{node}",
                                        daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        store = self.store
        reader = SlotReader(store, lambda i: P.agent_request_key(self.node, i),
                            count_key=P.agent_key(self.node, "req/count"),
                            on_reject=self.on_reject)
        try:
            while True:
                # nothing came within recheck_s: look for a hole, then wait again
                taken = take_or_wait(reader, store, self.recheck_s)
                if taken is None:
                    continue
                key, raw = taken
                # handled once: deleted, and counted so that a resumed controller fills only
                # the holes after it
                store.delete_key(key)
                store.add(P.agent_key(self.node, "req/done"), 1)
                try:
                    self.queue.put(P.decode_agent_request(raw))
                except P.MessageError as exc:
                    # never half-obeyed, never fatal: the agent may host the job's store
                    self.on_reject(key, str(exc))
                    continue
                self.wake()
        except Exception as exc:  # noqa: BLE001 - the store is gone: the loop learns of it
            self.error = exc
            self.wake()

    def poll(self) -> list[P.AgentRequest]:
        return drain(self.queue)


def await_genuine(store, key: str) -> bytes:
    """``key``'s genuine value, once it is there (a forged one planted first is waited past:
    the genuine writer overwrites it). One waiting request at a time, however long."""
    while True:
        try:
            store.wait([key], timedelta(seconds=P.IDLE_WAIT_S))
        except StoreTimeout:
            continue
        value = store.valid(key)
        if value is not None:
            return value
        time.sleep(FORGED_POLL_S)


class FenceWatch:
    """Sets ``fenced`` once the controller's signed word is at ``agent/<node>/fenced`` (a
    forged value there is no word: it is waited past)."""

    def __init__(self, store, node: int, wake: Callable[[], None]):
        self.store, self.node, self.wake = store, node, wake
        self.fenced = threading.Event()
        self.error: BaseException | None = None
        threading.Thread(target=self._loop, name=f"fence-{node}", daemon=True).start()

    def _loop(self) -> None:
        try:
            await_genuine(self.store, P.agent_key(self.node, "fenced"))
            self.fenced.set()
            self.wake()
        except Exception as exc:  # noqa: BLE001 - the store is gone
            self.error = exc
            self.wake()
