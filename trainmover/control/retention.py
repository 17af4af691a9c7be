"""The controller's driver for the store's size: keys nobody can read again are deleted, so a
job of 10^6 steps holds as many keys as one of 10^3.

The rule, per key family (``core/protocol.py``):
- ``commit/<epoch>/<step>/*`` (votes, decision, metrics): once step ``s + margin`` of the
  same epoch is committed, no worker is at step ``s`` any more (a worker cannot start a step
  before the previous one is decided) and the controller has read ``s``'s decision; the keys
  of an epoch that ended (a recovery or restart moved on) go once the new epoch commits;
- ``hb/<worker>/<pid>``: when the agent reports that process's exit; ``perf/<worker>`` (one
  per worker, overwritten every window) too;
- ``mig/<id>/*`` of a migration that completed, once its accounting is written; those of an
  aborted migration stay (a participant may still be waiting to read ``abort``);
- ``fail/<epoch>/<worker>`` and ``recovery/<id>/recovered_count``, once the recovery's
  accounting is written.
Everything else is bounded by the number of processes, migrations and recoveries.
"""
from __future__ import annotations

from trainmover.control.context import JobContext
from trainmover.core import protocol as P


MARGIN_STEPS = 2
"""Steps kept behind the last committed one: a worker is at most one step past it (it cannot
start a step before the previous one is decided), and an abort may decide the next two."""


class Retention:
    STATE = ("started", "cleared", "high")

    def __init__(self, ctx: JobContext):
        self.ctx = ctx
        self.started: dict[str, int] = {}    # epoch -> its first step (its resume step)
        self.cleared: dict[str, int] = {}    # epoch -> first step whose keys may remain
        self.high: dict[str, int] = {}       # epoch -> highest step voted in it, at most

    def poll(self) -> None:
        """Delete the commit keys of decided steps, every ``controller.gc_every_steps``."""
        ctx = self.ctx
        every = ctx.cfg.controller.gc_every_steps
        if not every or ctx.committed < 0:
            return
        epoch, committed = str(ctx.epoch), ctx.committed
        if epoch not in self.started:
            self.started[epoch] = self.cleared[epoch] = committed + 1
        self.high[epoch] = max(self.high.get(epoch, -1), committed + 1)
        upto = committed - MARGIN_STEPS
        if upto - self.cleared[epoch] >= every:
            self._delete_steps(ctx.epoch, self.cleared[epoch], upto)
            self.cleared[epoch] = upto
        if committed < self.started[epoch]:
            return
        # the current epoch committed a step: every worker left the older epochs
        for old in [e for e in self.started if int(e) < ctx.epoch]:
            self._delete_steps(int(old), self.cleared.pop(old),
                               self.high.pop(old) + MARGIN_STEPS + 1)
            del self.started[old]

    def _delete_steps(self, epoch: int, start: int, stop: int) -> None:
        store = self.ctx.store
        for step in range(start, stop):
            for what in P.COMMIT_KEYS:
                store.delete_key(P.commit_key(epoch, step, what))

    def process_exited(self, name: str, pid: int | None) -> None:
        if pid is not None:
            self.ctx.store.delete_key(P.heartbeat_key(name, pid))
        self.ctx.store.delete_key(P.perf_key(name))

    def migration_done(self, migration_id: int, participants: list[str],
                       leavers: list[str]) -> None:
        store = self.ctx.store
        for what in ("ready_count", "switched_count", "go", "switch_at", "abort"):
            store.delete_key(P.mig_key(migration_id, what))
        for w in participants:
            for what in ("ready", "switched"):
                store.delete_key(P.mig_key(migration_id, what, w))
        for w in leavers:
            for what in ("at_switch", "outcome"):
                store.delete_key(P.mig_key(migration_id, what, w))

    def recovery_done(self, recovery_id: int, epochs: list[int], workers: list[str]) -> None:
        store = self.ctx.store
        store.delete_key(P.recovered_count_key(recovery_id))
        for epoch in epochs:
            store.delete_key(P.failure_count_key(epoch))
            for w in workers:
                store.delete_key(P.failure_key(epoch, w))
