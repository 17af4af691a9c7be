"""What the hosts' agents relay to the controller in a recovery, read a host at a time: the
survivors' failure reports (``P.HostReports``) and the participants' notes that they are
done (``P.HostRecovered``). Each is one signed value a host, which names only that host's
processes (an agent hears a process on a channel no other process can write); a process
no agent started writes its own key, read only for a process whose host is not known.

The counters beside them (``fail/<epoch>/count``, ``recovery/<id>/recovered_count``) are
hints of when to look, never the answer: any client past the store's handshake can add to
a counter, and a count pushed up must not end a recovery early, nor one pushed down keep
it from ending (``RecoveredNotes``).
"""
from __future__ import annotations

import time

from trainmover.control.context import JobContext, read_messages
from trainmover.core import protocol as P


def _by_host(ctx: JobContext, workers) -> tuple[dict[int, set[str]], list[str]]:
    """``workers`` by the host that runs them, and those whose host is not known."""
    by_host: dict[int, set[str]] = {}
    own = []
    for w in workers:
        node = ctx.hosts.get(w)
        if node is None:
            own.append(w)
        else:
            by_host.setdefault(node, set()).add(w)
    return by_host, own


def read_failure_reports(ctx: JobContext, epoch: int, workers: list[str],
                         silent: set[str] | None = None) -> dict[str, P.FailureReport]:
    """The failure reports in ``epoch`` of ``workers`` that came: a worker's only from its
    own host's value, or from its own key if its host is not known. ``KEYS_PER_READ`` keys
    a request. ``silent`` (if given) gets those of ``workers`` their own host's agent
    named silent (``P.HostReports.silent``) and did not report."""
    out: dict[str, P.FailureReport] = {}
    by_host, own = _by_host(ctx, workers)
    nodes = sorted(by_host)
    keys = [P.host_reports_key(n, epoch) for n in nodes]
    for node, key, host in zip(nodes, keys, read_messages(ctx, P.HostReports, keys)):
        if host is not None and host.epoch != epoch:
            ctx.events.emit("message_rejected", key=key, error=f"epoch {host.epoch}")
        elif host is not None:
            out.update((w, r) for w, r in host.reports.items() if w in by_host[node])
            if silent is not None:
                silent.update(w for w in host.silent
                              if w in by_host[node] and w not in host.reports)
    keys = [P.failure_key(epoch, w) for w in own]
    out.update((w, r) for w, r in zip(own, read_messages(ctx, P.FailureReport, keys))
               if r is not None)
    return out


def read_recovery_notes(ctx: JobContext, recovery_id: int, workers) -> set[str]:
    """Which of ``workers`` noted that their part of recovery ``recovery_id`` is done: a
    worker only in its own host's ``HostRecovered`` of that recovery (or its own key if its
    host is not known)."""
    out: set[str] = set()
    by_host, own = _by_host(ctx, workers)
    nodes = sorted(by_host)
    keys = [P.host_recovered_key(n, recovery_id) for n in nodes] + \
        [P.own_recovered_key(recovery_id, w) for w in own]
    names = [by_host[n] for n in nodes] + [{w} for w in own]
    for key, note, mine in zip(keys, read_messages(ctx, P.HostRecovered, keys), names):
        if note is not None and note.recovery_id != recovery_id:
            ctx.events.emit("message_rejected", key=key,
                            error=f"recovery {note.recovery_id}")
        elif note is not None:
            out.update(w for w in note.processes if w in mine)
    return out


class RecoveredNotes:
    """When the controller reads a recovery's notes: when the count reaches the number of
    participants and has moved since the last read (a forged add makes it look once more,
    and ends nothing), and at most every ``recheck_s`` while it stays short (a forged
    subtraction leaves the count short of what came)."""

    def __init__(self, ctx: JobContext, recheck_s: float):
        self.ctx, self.recheck_s = ctx, recheck_s
        # (recovery id, the count at the last read, when): None before the first look
        self._seen: tuple[int, int, float] | None = None
        self._short_said: set[int] = set()

    def all_done(self, recovery_id: int, participants: set[str]) -> bool:
        ctx, now = self.ctx, time.monotonic()
        count = ctx.store.add(P.recovered_count_key(recovery_id), 0)
        seen = self._seen
        if seen is None or seen[0] != recovery_id:
            seen = self._seen = (recovery_id, -1, now)
        if count >= len(participants):
            if count == seen[1] and now - seen[2] < self.recheck_s:
                return False
        elif now - seen[2] < self.recheck_s:
            return False
        self._seen = (recovery_id, count, now)
        noted = read_recovery_notes(ctx, recovery_id, participants)
        if len(noted) == len(participants):
            return True
        if count >= len(participants) and recovery_id not in self._short_said:
            # the count says done and the notes do not: someone added to it (or a note is
            # not readable); the notes decide
            self._short_said.add(recovery_id)
            ctx.events.emit("recovered_count_ahead", recovery_id=recovery_id, count=count,
                            noted=len(noted), participants=len(participants),
                            level="warning")
        return False
