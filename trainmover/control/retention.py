"""The controller's driver for the store's size: keys nobody can read again are deleted, so a
job of 10^6 steps holds as many keys as one of 10^3.

The rule, per key family (``core/protocol/keys.py``):
- ``commit/<epoch>/<step>/*`` (votes, decision, metrics): once step ``s + margin`` of the
  same epoch is committed, no worker is at step ``s`` any more (a worker cannot start a step
  before the previous one is decided) and the controller has read ``s``'s decision; the keys
  of an epoch that ended (a recovery or restart moved on) go once the new epoch commits;
- heartbeats are one key a host (``agent/<node>/hb``), overwritten: nothing to delete;
- ``mig/<id>/*`` of a migration that completed, once its accounting is written; those of an
  aborted migration stay (a participant may still be waiting to read ``abort``);
- ``fail/<epoch>/<worker>``, the hosts' reports and notes (``agent/<node>/reports/<epoch>``,
  ``agent/<node>/recovered/<id>``), ``recovery/<id>/recovered_count`` and
  ``.../recovered/<worker>``, and the aborted epochs' ``abort/<epoch>``, once the
  recovery's accounting is written;
- ``agent/exit/<n>`` (exit records), once a controller snapshot that counts them as read is
  saved (a resumed controller starts after them);
- a process's own keys (``membership/worker/<name>``, its standby state,
  ``agent/proc/<name>``), once it is out of the job for good: a dead
  standby at its exit, a migration's leaver when the migration is accounted, a failed worker
  when its recovery is; the processes' commands (``agent/<node>/cmd/<n>``) and agent
  requests are deleted by the agent as it reads them (a host declared lost leaves the few
  it had not read), a `trainmover migrate` request's keys by the client that made it;
- ``mig/<id>/*`` of an aborted or interrupted migration, when a later one is accounted;
- a communicator's rendezvous keys (``groups/<name>/gen<g>/...``: gloo's one a member,
  NCCL's unique id), once a migration or
  recovery that replaced generation ``g`` is accounted (no one builds it again); a
  transfer channel's, with its migration or recovery.
Everything else is bounded by the job's size (roles, hosts, structures), not its length.

A key found dead is deleted only after the controller's next snapshot save: the state that
no longer needs it is then what a resumed controller starts from.
"""
from __future__ import annotations

from trainmover.control.context import JobContext
from trainmover.core import protocol as P


MARGIN_STEPS = 2
"""Steps kept behind the last committed one: a worker is at most one step past it (it cannot
start a step before the previous one is decided), and an abort may decide the next two."""


class Retention:
    STATE = ("started", "cleared", "high", "exits_deleted", "generations_deleted")

    def __init__(self, ctx: JobContext):
        self.ctx = ctx
        self.started: dict[str, int] = {}    # epoch -> its first step (its resume step)
        self.cleared: dict[str, int] = {}    # epoch -> first step whose keys may remain
        self.high: dict[str, int] = {}       # epoch -> highest step voted in it, at most
        self.exits_deleted = 0               # exit records deleted up to this index
        self.generations_deleted: dict[str, int] = {}   # group -> generations below deleted
        # Keys found dead this round, deleted once the snapshot of this round is saved: a
        # controller that dies before that save is resumed from a snapshot that still
        # needs them (a recovery not yet marked complete waits for its recovered count; one
        # dead controller's successor waited for a deleted count forever). Not snapshotted:
        # the successor decides the same deletions again.
        self._doomed: list[str] = []

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
        for step in range(start, stop):
            for what in P.COMMIT_KEYS:
                self._drop(P.commit_key(epoch, step, what))

    def process_exited(self, name: str, pid: int | None) -> None:
        m = self.ctx.membership
        if m is not None and name in m.standbys and name not in m.workers:
            self.process_gone(name)    # a standby that exited never comes back

    def _drop(self, key: str) -> None:
        self._doomed.append(key)

    def snapshot_saved(self, exits_seen: int) -> None:
        """A controller snapshot was saved, counting ``exits_seen`` exit records as read and
        holding the state in which the keys doomed so far are dead: they go now."""
        doomed, self._doomed = self._doomed, []
        # the exit records the save counted as read go too
        doomed += [P.agent_exit_key(i) for i in range(self.exits_deleted + 1, exits_seen + 1)]
        if doomed:
            # in batches: a recovery's end dooms two keys a worker (its report and note
            # keys, written only by a process no agent started, but deleted either way)
            self.ctx.store.delete_keys(doomed)
        self.exits_deleted = max(self.exits_deleted, exits_seen)

    def replaced_groups(self, channels: list[tuple[str, int]] = ()) -> None:
        """Delete the rendezvous keys of every communicator generation older than the live
        one, and of the given transfer channels (name, generation)."""
        m, backend = self.ctx.membership, self.ctx.cfg.comm.backend
        for name, live in m.generations.items():
            old = range(self.generations_deleted.get(name, 0), live)
            size = m.layout.group(name).size if old else 0
            for gen in old:
                for key in P.group_keys(name, gen, size, backend):
                    self._drop(key)
            self.generations_deleted[name] = max(live, self.generations_deleted.get(name, 0))
        for name, gen in channels:
            for key in P.group_keys(name, gen, 2, backend):
                self._drop(key)

    def process_gone(self, name: str) -> None:
        """``name`` is out of the job for good (see the module doc): its own keys go."""
        for key in (P.membership_key(name), P.standby_state_key(name), P.agent_proc_key(name)):
            self._drop(key)

    def migration_done(self, migration_id: int, participants: list[str],
                       leavers: list[str]) -> None:
        for what in ("ready_count", "switched_count", "go", "switch_at", "abort"):
            self._drop(P.mig_key(migration_id, what))
        for w in participants:
            for what in ("ready", "switched", "steps"):
                self._drop(P.mig_key(migration_id, what, w))
        for w in leavers:
            for what in ("at_switch", "outcome"):
                self._drop(P.mig_key(migration_id, what, w))

    def migration_accounted(self, migration_id: int, participants: list[str],
                            leavers: list[str], channels: list[tuple[str, int]]) -> None:
        """A migration that completed: its keys, and its leavers' (they left the job)."""
        self.migration_done(migration_id, participants, leavers)
        for w in leavers:
            self.process_gone(w)
        self.replaced_groups(channels)

    def recovery_done(self, recovery_id: int, epochs: list[int], workers: list[str],
                      failed: list[str] = (), channels: list[tuple[str, int]] = ()) -> None:
        for w in failed:
            self.process_gone(w)
        self.replaced_groups(channels)
        self._drop(P.recovered_count_key(recovery_id))
        nodes = range(self.ctx.procs.nnodes)
        for node in nodes:
            self._drop(P.host_recovered_key(node, recovery_id))
        for w in workers:
            self._drop(P.own_recovered_key(recovery_id, w))
        for epoch in epochs:
            self._drop(P.abort_key(epoch))
            self._drop(P.failure_count_key(epoch))
            for w in workers:
                self._drop(P.failure_key(epoch, w))
            for node in nodes:
                self._drop(P.host_reports_key(node, epoch))
