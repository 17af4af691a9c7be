"""The controller's driver for unexpected failures: on what ``health.Health`` detects, fence,
abort the step in flight, collect the survivors' accounts, plan (``decisions.plan_recovery``),
command, and account.

A hung worker is *fenced*: killed with SIGKILL. gloo cannot cancel an operation and a stopped
peer keeps its sockets open, so without fencing the survivors would wait for the group
timeout; with it, a hang costs at most the heartbeat timeout. A worker whose own
communicator failed is fenced and replaced too. Then the step in flight is aborted everywhere
(``abort/<epoch>`` wakes every survivor out of any wait, and the step's commit decision is
set to ``abort`` unless it was already ``commit``), so no survivor is ever stuck past the
bound. A survivor that still beats but sends no report is fenced as hung once its host's
agent names it silent (no report ``recovery.report_timeout_s`` after the abort reached the
host), or, without that word, twice that after the last report read (or the abort), and
one still silent ``recovery.report_wait_max_s`` after the abort, however many reports
keep coming (``decisions.silent_survivors``).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from trainmover.control.baseline import Restarts
from trainmover.control.context import JobContext
from trainmover.control.errors import JobFailed
from trainmover.control.health import Failure, Health
from trainmover.control.host_notes import RecoveredNotes, read_failure_reports
from trainmover.control.migrations import Migrations
from trainmover.control.retention import Retention
from trainmover.core import decisions as C
from trainmover.core import protocol as P
from trainmover.core.accounting import downtime_phrase
from trainmover.core.auth import read_valid
from trainmover.core.codec import Table
from trainmover.core.events import JsonlWriter
from trainmover.core.files import usable_checkpoints
from trainmover.core.snapshots import SnapshotClient, SnapshotUnavailable, usable_snapshot


@dataclass
class ActiveRecovery:
    recovery_id: int
    epoch: int                       # the epoch whose step was aborted
    failures: dict[str, Failure]
    t_detected: float
    last_committed: int
    state: str = "collecting"        # collecting -> recovering -> done
    plan: C.RecoveryPlan | None = None
    t_planned: float | None = None
    # every survivor's, as they come (a Table: the snapshot encodes it again only when one
    # came)
    reports: dict[str, P.FailureReport] = field(default_factory=Table)
    replacements: list[str] = field(default_factory=list)   # processes started for it
    t_collect: float | None = None      # when collecting reports began (if not at detection)
    t_report: float | None = None       # when the last survivor's report was read
    abandoned: list[int] = field(default_factory=list)      # ids of plans given up before
    resume_step: int | None = None      # set by the plan

    def __post_init__(self) -> None:
        if not isinstance(self.reports, Table):   # read back from an older snapshot
            self.reports = Table(self.reports)


class Recovery:
    """Polled on every supervision round."""

    STATE = ("active", "done", "count", "failed_workers", "awaiting", "skipped_checkpoints",
             "skipped_snapshots")

    def __init__(self, ctx: JobContext, health: Health, migrations: Migrations,
                 restarts: Restarts, retention: Retention):
        self.ctx = ctx
        self.health = health
        self.migrations = migrations
        self.restarts = restarts
        self.retention = retention
        self.active: ActiveRecovery | None = None
        self.done: list[dict] = []
        self.count = 0
        self.failed_workers: set[str] = set()
        self.awaiting: list[ActiveRecovery] = []   # done, downtime not yet known
        self._committed_read_at = float("-inf")
        self.skipped_checkpoints: list[int] = []   # reported once each
        # snapshot steps a plan failed with (an unreachable or broken copy): not used again,
        # the next plan takes an older snapshot or a checkpoint
        self.skipped_snapshots: list[int] = []
        # (recovery id, when, whether a complete snapshot or checkpoint was there): asked at
        # most once a report timeout while silent survivors wait (a round trip a host)
        self._copy_seen: tuple[int, float, bool] | None = None
        self._deferred: set[int] = set()     # recoveries whose deferred fencing was said
        self._notes = RecoveredNotes(ctx, ctx.cfg.recovery.report_timeout_s)
        self._failures_seen: tuple[int, int] | None = None   # (epoch, count) last read

    # --- the state machine ------------------------------------------------------------------
    def poll(self) -> None:
        ctx = self.ctx
        now = time.monotonic()
        if self.active is not None or now - self._committed_read_at >= \
                ctx.cfg.health.check_interval_s:
            self._committed_read_at = now
            self._advance_committed()
        handled = set(self.active.failures) if self.active else set()
        new = self.health.detect(handled | self.failed_workers)
        if new and self.active is None:
            self._start(new)
        elif new:
            # a failure while recovering: fence it too and go on with the wider set (a plan
            # already sent is abandoned: it counted on the worker that just failed)
            for f in new:
                ctx.fence(f.worker, f.kind)
                self.active.failures[f.worker] = f
            ctx.events.emit("failure_during_recovery", workers=[f.worker for f in new])
            if self.active.state == "recovering":
                self._abandon(self.active, ", ".join(f"{f.worker} {f.kind}" for f in new))
        if self.active is not None:
            self._advance()

    def _advance_committed(self) -> None:
        ctx = self.ctx
        # a forged decision reads as none (valid): the step is decided when its voters say
        while ctx.store.valid(P.commit_key(ctx.epoch, ctx.committed + 1, "decision")) == \
                b"commit":
            ctx.committed += 1

    def _start(self, failures: list[Failure]) -> None:
        ctx = self.ctx
        if ctx.cfg.baseline.restart_on_failure:
            return self.restarts.after_failure(failures)
        self.count += 1
        t = time.time()
        for f in failures:
            if f.kind != "crash":
                ctx.fence(f.worker, f.kind)
        reason = ", ".join(f"{f.worker} {f.kind} ({f.detail})" for f in failures)
        # the abort key goes out at once: the survivors are blocked until they see it, and a
        # resumed controller that repeats it writes the same key again
        ctx.store.set(P.abort_key(ctx.epoch), reason)
        last = decide_abort(ctx.store, ctx.epoch, ctx.committed + 1)
        ctx.committed = last
        if self._all_committed(set(f.worker for f in failures)):
            return self._after_the_last_step(failures)
        self.active = ActiveRecovery(self.count, ctx.epoch, {f.worker: f for f in failures},
                                     t, last)
        ctx.events.emit("failure_detected", recovery_id=self.count, epoch=ctx.epoch,
                         failures=[f.__dict__ for f in failures], last_committed_step=last)
        ctx.progress.say(f"failure: {reason}; step {last + 1} aborted everywhere, "
                          f"last committed step {last}")
        self.migrations.settle(f"failure during the migration: {reason}")

    def _advance(self) -> None:
        rec = self.active
        ctx = self.ctx
        if rec.state == "collecting":
            if self._all_committed(set(rec.failures)):
                # the survivors finished the last step meanwhile: nothing to recover
                self.active = None
                return self._after_the_last_step(list(rec.failures.values()))
            survivors = [w for w in ctx.membership.workers if w not in rec.failures]
            unread = [w for w in survivors if w not in rec.reports]
            said_silent: set[str] = set()
            read = read_failure_reports(ctx, rec.epoch, unread, said_silent)
            now = time.time()
            if read:
                rec.reports.update(read)
                rec.t_report = now
            missing = [w for w in unread if w not in rec.reports]
            if missing:
                since = rec.t_collect or rec.t_detected
                cfg = ctx.cfg.recovery
                # alive (beating) yet silent while the others' reports stopped coming: hung
                silent = C.silent_survivors(missing, now - since,
                                            now - max(since, rec.t_report or since),
                                            cfg.report_timeout_s, cfg.report_wait_max_s,
                                            said_silent,
                                            {w for w in missing if w in ctx.hosts})
                why = C.fence_silent_later(
                    ctx.membership, set(rec.failures), silent, now - since,
                    cfg.report_wait_max_s, lambda: self._copy_available(rec)) \
                    if silent else None
                if why is not None:
                    self._defer_fencing(rec, len(silent), why)
                    return
                for w in silent:
                    ctx.fence(w, "no report after abort")
                    rec.failures[w] = Failure(w, "hang", now, "no report after abort")
                return
            self._plan(rec)
        elif rec.state == "recovering":
            dead = [j for j in rec.plan.joiners if ctx.procs.exit_code(j) not in (None, 0)]
            if dead:
                self._abandon(rec, f"joiner {', '.join(dead)} died")
                return
            count = ctx.store.add(P.failure_count_key(ctx.epoch), 0)
            if count > 0 and (ctx.epoch, count) != self._failures_seen:
                # a participant could not carry out its part (a corrupt checkpoint, a group
                # build that failed) and waits for another plan. The count is a hint (anyone
                # past the store's handshake can add to it): its signed report decides,
                # read again only when the count moves.
                self._failures_seen = (ctx.epoch, count)
                failed = read_failure_reports(ctx, ctx.epoch, sorted(ctx.membership.workers))
                if failed:
                    self._abandon(rec, "; ".join(f"{w} failed while recovering: {r.error}"
                                                 for w, r in failed.items()))
                    return
            participants = set(rec.plan.joiners) | {w for w in ctx.membership.workers
                                                   if w not in rec.failures}
            if self._notes.all_done(rec.recovery_id, participants):
                self._complete(rec, len(participants))

    def _copy_available(self, rec: ActiveRecovery) -> bool:
        """Whether a complete snapshot or checkpoint could stand in for roles left without
        a replica (``decisions.fence_silent_later``); asked again at most once a report
        timeout (a round trip a host)."""
        ctx, now = self.ctx, time.time()
        seen = self._copy_seen
        if seen is None or seen[0] != rec.recovery_id or \
                now - seen[1] > ctx.cfg.recovery.report_timeout_s:
            newest = rec.last_committed + 1
            ok = self.newest_checkpoint(newest) is not None or \
                self.newest_snapshot(newest)[0] is not None
            seen = self._copy_seen = (rec.recovery_id, now, ok)
        return seen[2]

    def _defer_fencing(self, rec: ActiveRecovery, silent: int, why: str) -> None:
        """Said once a recovery: survivors that sent no report are not fenced yet."""
        if rec.recovery_id in self._deferred:
            return
        self._deferred.add(rec.recovery_id)
        ctx = self.ctx
        ctx.events.emit("fencing_deferred", recovery_id=rec.recovery_id, silent=silent,
                        reason=why, level="warning")
        ctx.progress.say(f"recovery {rec.recovery_id}: {silent} survivor(s) sent no report, "
                         f"but fencing them now costs the job more than it can take ({why}): "
                         f"waiting for them, at most recovery.report_wait_max_s="
                         f"{ctx.cfg.recovery.report_wait_max_s:g} s")

    def _all_committed(self, failed: set[str]) -> bool:
        """The job's last step is committed: known from the step count, or because a
        survivor finished its steps (a script's count may be unknown to the controller)."""
        ctx = self.ctx
        total = ctx.cfg.train.steps
        if total and ctx.committed >= total - 1:
            return True
        # a few requests, not a round trip a worker (once most of a round of a recovery
        # of thousands of workers)
        return any(v is not None for v in read_valid(
            ctx.store, [P.finished_key(w) for w in ctx.membership.workers if w not in failed]))

    def _after_the_last_step(self, failures: list[Failure]) -> None:
        """A failure after the job's last step was committed: every role's state is final,
        so nothing is recovered. A failed holder of a data-parallel-rank-0 role (whose
        share of the final state may be missing) is stood in for by a live replica, which
        writes that share (and assembles the whole, for dp0.pp0.tp0); the job then ends
        as usual. Without a replica the final state cannot be assembled: the job stops,
        resumable from its checkpoints."""
        ctx = self.ctx
        names = sorted(f.worker for f in failures)
        for f in failures:
            ctx.fence(f.worker, f"{f.kind} after the last step")
        ctx.events.emit("failure_after_last_step", workers=names,
                        failures=[f.__dict__ for f in failures])
        holders = ctx.membership.workers
        m_layout = ctx.membership.layout
        for w in names:
            role = holders[w]
            if not m_layout.holds_final_share(role):
                continue
            replica = None if m_layout.dp_sharded else next(
                (x for x, r in sorted(holders.items())
                 if r.pp == role.pp and r.tp == role.tp and r.dp > 0
                 and x not in names and ctx.procs.exit_code(x) in (None, 0)), None)
            if replica is None:
                raise JobFailed(
                    f"{w} ({role}) failed after the job's last step was committed, before its "
                    f"share of the final state was surely written, and its role has no live "
                    f"replica: continue with `trainmover run --resume {ctx.run_dir}` (the last "
                    f"steps are replayed from the newest checkpoint)")
            ctx.put(P.final_need_key(role.name), replica)
            ctx.progress.say(f"{w} ({role}) {[f.kind for f in failures if f.worker == w][0]} "
                             f"after the last step: its replica {replica} writes its share of "
                             f"the final state")
        self.failed_workers |= set(names)

    def _abandon(self, rec: ActiveRecovery, reason: str) -> None:
        """The plan sent for ``rec`` cannot complete (one of its joiners, or a survivor,
        failed). Its joiners are retired, the recovery's epoch is aborted, which wakes every
        survivor out of the group builds, transfers or step it is in, and a new recovery
        for the same failed roles starts collecting their reports in that epoch."""
        ctx = self.ctx
        attempts = len(rec.abandoned) + 1
        if attempts >= ctx.cfg.recovery.max_attempts:
            raise JobFailed(f"recovery from {sorted(rec.failures)}: {attempts} plan(s) in a "
                            f"row given up (recovery.max_attempts={attempts}), the last because "
                            f"{reason}. Committed progress (step {ctx.committed}) and "
                            f"checkpoints are intact: see the joiners' logs, then continue "
                            f"with `trainmover run --resume {ctx.run_dir}`")
        if rec.plan.rollback_source == "snapshot":
            self.skipped_snapshots.append(rec.plan.rollback_step)
        for j in rec.plan.joiners:
            if ctx.procs.running(j):
                ctx.procs.kill(j)
            ctx.membership.standbys[j] = C.StandbyState.DEAD
        ctx.store.set(P.abort_key(ctx.epoch),
                      f"recovery {rec.recovery_id} abandoned: {reason}")
        last = decide_abort(ctx.store, ctx.epoch, ctx.committed + 1)
        ctx.committed = last
        ctx.events.emit("recovery_abandoned", recovery_id=rec.recovery_id, reason=reason,
                         epoch=ctx.epoch)
        ctx.progress.say(f"recovery {rec.recovery_id} abandoned ({reason}); planning again")
        self.count += 1
        self.active = ActiveRecovery(self.count, ctx.epoch, dict(rec.failures),
                                     rec.t_detected, last,
                                     replacements=rec.replacements, t_collect=time.time(),
                                     abandoned=rec.abandoned + [rec.recovery_id])

    def _plan(self, rec: ActiveRecovery) -> None:
        ctx = self.ctx
        m = ctx.membership
        holders = {w: r for w, r in m.workers.items() if w not in rec.failures}
        dirty = C.dirty_groups(m.layout, {w: r.accounting for w, r in rec.reports.items()},
                               holders)
        # a rollback goes no further than the step after the last committed one (a copy of a
        # later step is left from a trajectory an earlier rollback undid)
        newest = rec.last_committed + 1
        ckpt = self.newest_checkpoint(newest)
        snap, snapshot_at = self.newest_snapshot(newest) \
            if C.without_replica(m, set(rec.failures)) else (None, {})
        short = len(rec.failures) - len(m.free_standbys())
        if short > 0 and ctx.cfg.recovery.replace_without_standby:
            self._start_replacements(rec, short)
        try:
            plan = C.plan_recovery(m, rec.recovery_id, sorted(rec.failures), dirty, ckpt,
                                   snapshot_step=snap,
                                   max_sources=ctx.cfg.recovery.stripe_sources)
        except C.RecoveryImpossible as exc:
            raise JobFailed(f"cannot recover from {C.listed(sorted(rec.failures))}: {exc}. "
                            f"Committed progress (step {rec.last_committed}) and checkpoints "
                            f"are intact.")
        rec.plan, rec.t_planned, rec.state = plan, time.time(), "recovering"
        ctx.disrupted()
        self._backfill_metrics(rec)
        ctx.membership = C.reserve(ctx.membership, plan)
        new_epoch = rec.epoch + 1
        resume = plan.rollback_step if plan.rollback_step is not None else rec.last_committed + 1
        rec.resume_step = resume
        ctx.events.emit("recovery_planned", epoch=new_epoch, resume_step=resume,
                         dirty_groups=sorted(dirty), **plan.describe())
        ctx.progress.say(
            "recovery: " + ", ".join(f"{p.leaver} -> {p.joiner} ({p.role}, state from "
                                     f"{'+'.join(self._sources(plan, p))})" for p in plan.pairs)
            + f"; rebuilding {len(plan.generations)}/{plan.groups_total} groups; resuming at "
              f"step {resume}")
        senders: dict[str, list[P.SendState]] = {}
        for p in plan.pairs:
            # a share of the state from each replica sending it (one, unless striped); a
            # replica serving several joiners sends to one after the other
            replicas = plan.senders(p.role.name)
            channels = [C.recovery_channel(r, p.joiner) for r in replicas]
            for i, (r, channel) in enumerate(zip(replicas, channels)):
                senders.setdefault(r, []).append(
                    P.SendState(p.joiner, channel, rec.recovery_id, i, len(replicas)))
            ctx.send(p.joiner, P.AssignRecovery(
                rec.recovery_id, p.role.name, new_epoch, resume,
                {s.name: plan.generations[s.name] for s in m.layout.groups_of(p.role).values()
                 if s.name in plan.generations},
                P.StateSource("replica", channels[0], rec.recovery_id,
                              more_groups=channels[1:] or None) if channels
                else P.StateSource(plan.rollback_source, step=plan.rollback_step,
                                   address=snapshot_at.get(p.role.name))))
        from_snapshot = plan.rollback_source == "snapshot"
        for w, role in ctx.membership.workers.items():
            if w in rec.failures:
                continue
            ctx.send(w, P.Recover(
                rec.recovery_id, new_epoch, resume, plan.rollback_step,
                {g: plan.generations[g] for g in plan.stayers.get(w, [])}, senders.get(w),
                rollback_from=snapshot_at[role.name] if from_snapshot else None))
        ctx.epoch = new_epoch
        ctx.committed = resume - 1
        ctx.reached("recovery")

    @staticmethod
    def _sources(plan: C.RecoveryPlan, p: C.Pair) -> list[str]:
        """Where a pair's state comes from, as said: "replica:w0", then any striped ones."""
        return [plan.sources[p.role.name]] + plan.stripes.get(p.role.name, [])

    def newest_checkpoint(self, at_most: int | None = None) -> int | None:
        """The newest complete checkpoint (of a step up to ``at_most``) that looks intact;
        each one skipped is reported once (an event and a line), with why."""
        ctx = self.ctx
        usable, skipped = usable_checkpoints(
            ctx.run_dir, [r.name for r in ctx.membership.layout.roles()])
        for step, why in sorted(skipped.items()):
            if step not in self.skipped_checkpoints:
                self.skipped_checkpoints.append(step)
                ctx.events.emit("checkpoint_skipped", step=step, reason=why, level="warning")
                ctx.progress.say(f"warning: the step-{step} checkpoint is skipped: {why}")
        usable = [s for s in usable if at_most is None or s <= at_most]
        return usable[-1] if usable else None

    def newest_snapshot(self, at_most: int) -> tuple[int | None, dict[str, str]]:
        """The newest step up to ``at_most`` of which every role's peer snapshot is held by
        a live holder, and each role's holder (``host:port``). Asks every live host's holder
        what it holds (a round trip each; one that does not answer is passed over)."""
        ctx = self.ctx
        if not ctx.cfg.takes_snapshots() or ctx.secret is None:
            return None, {}
        cfg = ctx.cfg.snapshot
        held = {}
        for node in range(ctx.procs.nnodes):
            key = P.agent_key(node, "snapshots")
            address = None if node in ctx.procs.lost else ctx.store.valid(key)
            if address is None:
                continue
            address = address.decode()
            try:
                held[address] = SnapshotClient(address, ctx.secret, cfg.connect_timeout_s,
                                               cfg.connect_timeout_s).list()
            except SnapshotUnavailable as exc:
                ctx.events.emit("snapshot_holder_unavailable", node=node, error=str(exc),
                                level="warning")
        for entries in held.values():
            entries[:] = [e for e in entries if e.step not in self.skipped_snapshots]
        found = usable_snapshot(held, [r.name for r in ctx.membership.layout.roles()],
                                at_most)
        return (None, {}) if found is None else found

    def _start_replacements(self, rec: ActiveRecovery, count: int) -> None:
        """No free standby for every failed role: start new standby processes (on a cluster,
        on newly allocated machines). They take the assignment as soon as they run; until
        then the job waits, degraded. Nothing restarts: survivors keep their processes,
        state and clean groups."""
        ctx = self.ctx
        names = []
        for _ in range(count):
            name = ctx.new_standby(C.StandbyState.STARTING)
            ctx.spawn(name, standby=True)
            names.append(name)
        rec.replacements.extend(names)
        ctx.events.emit("degraded", recovery_id=rec.recovery_id, reason="no free standby",
                         replacements=names)
        ctx.progress.say(f"no free standby for {', '.join(sorted(rec.failures))}: starting "
                          f"replacement {', '.join(names)}; the job waits for it (degraded)")

    def _backfill_metrics(self, rec: ActiveRecovery) -> None:
        """A reporter that died after its step was committed but before recording it: the
        record it left with its vote goes into metrics.jsonl, so every committed step has one."""
        ctx = self.ctx
        ctx.progress.poll()
        step = rec.last_committed
        if step < 0 or any(r["step"] == step for r in ctx.progress.records[-3:]):
            return
        key = P.commit_key(rec.epoch, step, "metrics")
        if ctx.store.check([key]):
            try:
                record = P.read_object(ctx.store.get(key))
            except P.MessageError as exc:
                ctx.events.emit("message_rejected", key=key, error=str(exc))
                return
            # the step time the reporter had measured at its vote (its optimizer step, which
            # the record would include, never ran): close, flagged as backfilled
            record.update(step_time_s=round(record["step_time_s"], 6), backfilled=True)
            writer = JsonlWriter(os.path.join(ctx.run_dir, "metrics.jsonl"))
            writer.write(record)
            writer.close()
            ctx.events.emit("metrics_backfilled", step=step, worker=record["worker"])

    def _complete(self, rec: ActiveRecovery, participants: int) -> None:
        ctx = self.ctx
        plan = rec.plan
        ctx.membership = C.commit(ctx.membership, C.MigrationPlan(
            rec.recovery_id, plan.pairs, plan.generations, plan.stayers, plan.groups_total))
        for p in plan.pairs:
            ctx.put(P.membership_key(p.joiner), p.role.name)
        self.failed_workers |= set(rec.failures)
        rec.state = "done"
        # every participant said its part is done (the downtime, ``recovery_done``, waits
        # for the first step committed after it)
        ctx.events.emit("recovery_resumed", recovery_id=rec.recovery_id,
                        participants=participants,
                        since_plan_s=round(time.time() - rec.t_planned, 4))
        ctx.disrupted()
        self.active = None
        self.awaiting.append(rec)

    def finish_downtimes(self, final: bool = False) -> None:
        """A recovery's downtime is known once the job committed the first step after it."""
        for rec in list(self.awaiting):
            # after a rollback the newest step seen is still the one before the failure: wait
            # for the resume step's own record, committed after the failure was detected
            if not final and self._first_commit(rec) is None:
                continue
            self.awaiting.remove(rec)
            self.report(rec)

    def _first_commit(self, rec: ActiveRecovery) -> float | None:
        """When the resume step was committed after the failure, if it was yet."""
        return next((r["time"] for r in self.ctx.progress.records
                     if r["step"] == rec.resume_step and r["time"] > rec.t_detected), None)

    def report(self, rec: ActiveRecovery) -> dict:
        """Downtime from the fault to the first committed step after it (needs its metrics)."""
        ctx = self.ctx
        resume = rec.resume_step
        t_commit = self._first_commit(rec)
        faults = [e for e in ctx.fault_events() if e["worker"] in rec.failures]
        t_fault = min([e["time"] for e in faults] or [rec.t_detected])
        detection = {w: f.detected_at - next((e["time"] for e in faults if e["worker"] == w),
                                             f.detected_at)
                     for w, f in rec.failures.items()}
        result = {"status": "done", **rec.plan.describe(), "resume_step": resume,
                  "replacements": rec.replacements, "abandoned_plans": rec.abandoned,
                  "last_committed_step": rec.last_committed,
                  "lost_steps": rec.last_committed + 1 - resume,
                  "failures": {w: f.kind for w, f in rec.failures.items()},
                  "detection_latency_s": detection,
                  "downtime_s": None if t_commit is None else t_commit - t_fault,
                  "phases": {"detect_s": rec.t_detected - t_fault,
                             "collect_s": rec.t_planned - rec.t_detected,
                             "rebuild_and_first_step_s": None if t_commit is None
                             else t_commit - rec.t_planned}}
        self.done.append(result)
        ctx.events.emit("recovery_done", **result)
        # each plan given up moved the recovery one epoch on: reports went to each of them
        self.retention.recovery_done(
            rec.recovery_id, list(range(rec.epoch - len(rec.abandoned), rec.epoch + 1)),
            sorted(set(ctx.membership.workers) | set(rec.failures)), sorted(rec.failures),
            [(C.recovery_channel(r, p.joiner), rec.recovery_id)
             for p in rec.plan.pairs for r in rec.plan.senders(p.role.name)])
        if t_commit is not None:
            src = ", ".join(sorted(set(rec.plan.sources.values())))
            ctx.progress.say(
                f"recovered from {', '.join(f'{w} {f.kind}' for w, f in rec.failures.items())}:"
                f" detection {max(detection.values()):.3f} s, "   # worded as everywhere:
                f"{downtime_phrase(result['downtime_s'], None)} "  # core/accounting.py
                f"(fault to first committed step), state from {src}")
        return result


def decide_abort(store, epoch: int, from_step: int) -> int:
    """Controller side: abort the first undecided step of ``epoch`` at or after ``from_step``.
    Returns the last committed step (steps decided ``commit`` meanwhile stay committed)."""
    step = from_step
    while True:
        got = store.compare_set(P.commit_key(epoch, step, "decision"), "", "abort").decode()
        if got == "abort":
            return step - 1
        step += 1
