"""The host's agent as the relay of two things its processes tell the controller through
the store in a recovery, each sent on the process's channel:

- a failure report (``P.FailureReport``, when its step failed): one signed
  ``P.HostReports`` a host and epoch, and one ``add`` of their number to the epoch's
  report count;
- that it recovered (``r <recovery id>``: a survivor once its part of a plan is done, a
  joiner after its first step): one signed ``P.HostRecovered`` a host and recovery, naming
  them, and one ``add`` of their number to the recovery's count.

Why: every survivor of a failure wrote its report and added to the count itself, and then
added to the recovered count, three requests a worker to the job's one store in every
recovery: 48K at 16K workers, 1.6 s of the store's thread on the path from a crash to its
plan for the reports alone (``benchmarks/report_cost.py``). Here the store sees about
three a host.

When a host's batch goes: as soon as every running process of the host that is not a
standby has sent it (for an epoch's reports, a recovery's notes), else ``coalesce_s``
after the batch's first message here (a process that does not send one: one that failed,
a standby; a joiner's note comes after its first step, in a second batch). A message that
comes after its host's batch went makes the agent write again, with it; the count grows
by the processes new in each write. An epoch's batch also starts when the agent sees the
epoch's abort (its abort watch): ``silent_after_s`` later it is written naming the
running processes that have not reported (``P.HostReports.silent``), so the controller
judges a silent process by its host's clock, not by when the host's value reached it.
The counts are hints of when to look: the controller takes the signed values as the
answer (``control/host_notes.py``). A process names only itself (its channel is its
own): the same message twice counts once, and a report that does not decode is reported
and dropped here.
"""
from __future__ import annotations

import collections
import threading
import time
from typing import Callable

from trainmover.core import protocol as P

BATCHES_KEPT = 8             # batches of each kind kept, to write again with a late message


class _Batch:
    """One epoch's reports or one recovery's notes on this host."""

    __slots__ = ("first", "items", "written", "aborted_at", "silent")

    def __init__(self):
        self.first = time.monotonic()
        self.items: dict = {}             # process -> its report (None for a note)
        self.written: set[str] = set()    # processes whose message went
        self.aborted_at: float | None = None   # when the agent saw the epoch's abort
        self.silent: set[str] = set()     # processes written as silent


class Reports:
    def __init__(self, store, node: int, coalesce_s: float,
                 expected: Callable[[], set[str]],
                 on_reject: Callable[[str, str], None] | None = None,
                 silent_after_s: float = 6.0):
        """``store``: a client of this relay's own; ``expected()``: the processes of the
        host that report when a step fails and note a recovery (running, not standbys);
        ``silent_after_s``: how long after an epoch's abort a process that sent no report
        is written as silent (``recovery.report_timeout_s``)."""
        self.store, self.node, self.coalesce_s = store, node, coalesce_s
        self.silent_after_s = silent_after_s
        self.expected, self.on_reject = expected, on_reject
        self.error: BaseException | None = None      # the store is gone
        self._cv = threading.Condition()
        # ("f", epoch) and ("r", recovery id) -> its batch; one ordered table a kind
        self._batches: dict[str, collections.OrderedDict[int, _Batch]] = {
            "f": collections.OrderedDict(), "r": collections.OrderedDict()}
        threading.Thread(target=self._run, name="report-relay", daemon=True).start()

    def received(self, name: str, epoch: int, payload: bytes) -> None:
        """Process ``name`` reported ``payload`` for ``epoch`` (the channels' reader)."""
        try:
            report = P.read_message(P.FailureReport, payload)
        except P.MessageError as exc:
            if self.on_reject is not None:
                self.on_reject(name, str(exc))
            return
        self._add("f", epoch, name, report)

    def recovered(self, name: str, recovery_id: int) -> None:
        """Process ``name`` is done with its part of recovery ``recovery_id``."""
        self._add("r", recovery_id, name, None)

    def aborted(self, epoch: int) -> None:
        """The controller aborted ``epoch`` (the agent's abort watch): its running
        processes that have not reported ``silent_after_s`` from now are written as
        silent (``P.HostReports.silent``)."""
        with self._cv:
            batch = self._batch("f", epoch)
            if batch.aborted_at is None:
                batch.aborted_at = time.monotonic()
                self._cv.notify()

    def _batch(self, kind: str, key: int) -> _Batch:
        table = self._batches[kind]
        batch = table.get(key)
        if batch is None:
            batch = table[key] = _Batch()
            while len(table) > BATCHES_KEPT:
                table.popitem(last=False)
        return batch

    def _add(self, kind: str, key: int, name: str, item) -> None:
        with self._cv:
            known = self._batches[kind].get(key)
            if kind == "r" and known is not None and name in known.items:
                return                       # counted already
            batch = self._batch(kind, key)
            batch.items[name] = item
            batch.written.discard(name)      # a second report of a process: written again
            self._cv.notify()

    def _due(self, now: float) -> tuple[list[tuple[str, int]], float | None]:
        """The batches to write now, and how long until the next one may be due."""
        due, wait = [], None
        expected = None

        def later(at: float) -> None:
            nonlocal wait
            wait = at - now if wait is None else min(wait, at - now)

        for kind, table in self._batches.items():
            for key, batch in table.items():
                if batch.aborted_at is not None:
                    if expected is None:
                        expected = self.expected()
                    quiet = expected - batch.items.keys() - batch.silent
                    if quiet:
                        at = batch.aborted_at + self.silent_after_s
                        if now >= at:
                            due.append((kind, key))
                            continue
                        later(at)
                if len(batch.written) == len(batch.items):
                    continue
                if expected is None:
                    expected = self.expected()
                if expected <= batch.items.keys() or now - batch.first >= self.coalesce_s:
                    due.append((kind, key))
                else:
                    later(batch.first + self.coalesce_s)
        return due, wait

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while True:
                        due, wait = self._due(time.monotonic())
                        if due:
                            break
                        self._cv.wait(wait)
                    work = []
                    expected = self.expected()
                    for kind, key in due:
                        batch = self._batches[kind][key]
                        if batch.aborted_at is not None and \
                                time.monotonic() >= batch.aborted_at + self.silent_after_s:
                            batch.silent = expected - batch.items.keys()
                        work.append((kind, key, dict(batch.items),
                                     sorted(batch.silent - batch.items.keys()),
                                     len(batch.items.keys() - batch.written)))
                        batch.written.update(batch.items)
                for kind, key, items, silent, new in work:
                    if kind == "f":
                        self.store.set(P.host_reports_key(self.node, key),
                                       P.write_message(P.HostReports(key, items, silent)))
                        if new:
                            self.store.add(P.failure_count_key(key), new)
                    else:
                        # the signed note first: the count only tells the controller when
                        # to read the notes (``control/host_notes.py``)
                        self.store.set(P.host_recovered_key(self.node, key),
                                       P.write_message(P.HostRecovered(key, sorted(items))))
                        self.store.add(P.recovered_count_key(key), new)
        except Exception as exc:  # noqa: BLE001 - the store is gone: the agent learns of it
            self.error = exc
