"""The host's agent as the relay of its processes' failure reports (``P.FailureReport``, sent
on each process's channel when its step failed): one signed ``P.HostReports`` a host and
epoch, and one ``add`` of their number to the epoch's report count.

Why: every survivor of a failure wrote its report and added to the count itself, two
requests a worker to the job's one store in every recovery: 32K at 16K workers, 1.6 s of the
store's thread on the path from a crash to its plan (``benchmarks/report_cost.py``). Here
the store sees about two a host.

When a host's reports go: as soon as every running process of the host that is not a
standby has reported in the epoch, else ``coalesce_s`` after the epoch's first report here
(a process that does not report: one that failed, or a standby). A report that comes after
its host's value went makes the agent write the value again, with it; the count grows by
the reports new in each write. A process names only itself (its channel is its own), and a
report that does not decode is reported and dropped here.
"""
from __future__ import annotations

import collections
import threading
import time
from typing import Callable

from trainmover.core import protocol as P

EPOCHS_KEPT = 8              # epochs whose reports are kept, to write again with a late one


class Reports:
    def __init__(self, store, node: int, coalesce_s: float,
                 expected: Callable[[], set[str]],
                 on_reject: Callable[[str, str], None] | None = None):
        """``store``: a client of this relay's own; ``expected()``: the processes of the
        host that report when a step fails (running, not standbys)."""
        self.store, self.node, self.coalesce_s = store, node, coalesce_s
        self.expected, self.on_reject = expected, on_reject
        self.error: BaseException | None = None      # the store is gone
        self._cv = threading.Condition()
        # epoch -> [first report's time, {process: report}, processes already written]
        self._epochs: collections.OrderedDict[int, list] = collections.OrderedDict()
        threading.Thread(target=self._run, name="report-relay", daemon=True).start()

    def received(self, name: str, epoch: int, payload: bytes) -> None:
        """Process ``name`` reported ``payload`` for ``epoch`` (the channels' reader)."""
        try:
            report = P.read_message(P.FailureReport, payload)
        except P.MessageError as exc:
            if self.on_reject is not None:
                self.on_reject(name, str(exc))
            return
        with self._cv:
            entry = self._epochs.get(epoch)
            if entry is None:
                entry = self._epochs[epoch] = [time.monotonic(), {}, set()]
                while len(self._epochs) > EPOCHS_KEPT:
                    self._epochs.popitem(last=False)
            entry[1][name] = report
            entry[2].discard(name)           # a second report of a process: written again
            self._cv.notify()

    def _due(self, now: float) -> tuple[list[int], float | None]:
        """The epochs to write now, and how long until the next one may be due."""
        due, wait = [], None
        for epoch, (first, reports, written) in self._epochs.items():
            if len(written) == len(reports):
                continue
            if self.expected() <= set(reports) or now - first >= self.coalesce_s:
                due.append(epoch)
            else:
                left = first + self.coalesce_s - now
                wait = left if wait is None else min(wait, left)
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
                    for epoch in due:
                        _, reports, written = self._epochs[epoch]
                        work.append((epoch, dict(reports), len(set(reports) - written)))
                        written.update(reports)
                for epoch, reports, new in work:
                    self.store.set(P.host_reports_key(self.node, epoch),
                                   P.write_message(P.HostReports(epoch, reports)))
                    self.store.add(P.failure_count_key(epoch), new)
        except Exception as exc:  # noqa: BLE001 - the store is gone: the agent learns of it
            self.error = exc
