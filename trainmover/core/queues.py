"""Reading a numbered queue of signed values in the store (``<prefix>/1``, ``/2``, ...: the
agent's requests, the commands to a host's processes) so that nobody without the job's
secret can make the reader lose a genuine value:

- a forged value at the head is not consumed: the genuine writer, which writes each index
  once and in order, overwrites it when it gets there (``set``);
- a head that stays empty or forged while a later slot holds a genuine value is a hole (an
  index handed out by a bumped counter, never written; a genuine value overwritten) and is
  skipped, after ``hole_timeout_s`` (a writer between taking an index and writing it is not a
  hole);
- nothing spins: the head is looked at again every ``poll_s`` while it stays forged.

Looking ahead costs a request only while the head is forged or the writer's counter says a
value should be there (``count_key``), never in the steady state of an idle queue.
"""
from __future__ import annotations

import time
from datetime import timedelta
from typing import Callable

from trainmover.core.auth import AuthError

MAX_REPORTED = 10_000   # forged slots remembered as reported


class SlotReader:
    def __init__(self, store, key_of: Callable[[int], str], count_key: str | None = None,
                 hole_timeout_s: float = 2.0, lookahead: int = 8, start: int = 1,
                 on_reject: Callable[[str, str], None] | None = None,
                 count_check_s: float = 1.0, clock=time.monotonic):
        self.store, self.key_of, self.count_key = store, key_of, count_key
        self.hole_timeout_s, self.lookahead = hole_timeout_s, lookahead
        self.count_check_s = count_check_s
        self.next_index = start
        self.on_reject = on_reject
        self.clock = clock
        self.head_forged = False            # the last take() found a forged value at the head
        self._stuck_since: float | None = None   # when the head was first found missing/forged
        self._count, self._count_at = 0, None    # the writer's counter, as last read
        self._reported: set[str] = set()          # forged slots reported (once each)

    @property
    def head_key(self) -> str:
        return self.key_of(self.next_index)

    def take(self) -> tuple[str, bytes] | None:
        """The next genuine value and its key (consumed: the index moves past it), or None if
        there is none yet (``head_forged`` says whether a forged one sits at the head)."""
        key = self.head_key
        self.head_forged = False
        if self.store.check([key]):
            value = self._genuine(key)
            if value is not None:
                return self._consume(key, value)
            self.head_forged = True
        elif not self._writer_is_past(self.next_index):
            self._stuck_since = None
            return None          # the idle steady state: nothing written yet
        now = self.clock()
        if self._stuck_since is None:
            self._stuck_since = now
        if now - self._stuck_since < self.hole_timeout_s:
            return None
        for ahead in range(self.next_index + 1, self.next_index + 1 + self.lookahead):
            later = self.key_of(ahead)
            if self.store.check([later]):
                value = self._genuine(later)
                if value is not None:
                    self.next_index = ahead
                    return self._consume(later, value)
        return None

    def _genuine(self, key: str) -> bytes | None:
        try:
            return self.store.get(key)
        except AuthError as exc:
            if key not in self._reported and self.on_reject is not None:
                if len(self._reported) >= MAX_REPORTED:
                    self._reported.clear()    # bounded memory; a key may be told twice
                self._reported.add(key)
                self.on_reject(key, str(exc))
            return None

    def _writer_is_past(self, index: int) -> bool:
        if self.count_key is None:
            return False
        now = self.clock()
        if self._count_at is None or now - self._count_at >= self.count_check_s:
            self._count, self._count_at = self.store.add(self.count_key, 0), now
        return self._count >= index

    def _consume(self, key: str, value: bytes) -> tuple[str, bytes]:
        self.next_index += 1
        self._stuck_since = None
        return key, value


FORGED_POLL_S = 0.05     # how long a reader sleeps while a forged value sits at the head


def take_or_wait(reader: SlotReader, store, wait_s: float):
    """The reader's next genuine value and its key, or None once it waited up to ``wait_s``
    for one to be written (a forged head: ``FORGED_POLL_S``, since the store's wait would
    return at once). Raises when the store is gone."""
    taken = reader.take()
    if taken is None:
        if reader.head_forged:
            time.sleep(FORGED_POLL_S)
        else:
            try:
                store.wait([reader.head_key], timedelta(seconds=wait_s))
            except Exception:  # noqa: BLE001 - a timeout (of its client's kind), or gone
                store.check([reader.head_key])          # raises if the store is gone
    return taken


def drain(q) -> list:
    """Everything a ``queue.Queue`` holds now, without waiting (a reader thread's hand-over
    to a loop that looks between its own work: commands, agent requests)."""
    import queue

    out = []
    while True:
        try:
            out.append(q.get_nowait())
        except queue.Empty:
            return out
