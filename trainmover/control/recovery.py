"""The controller's side of unexpected failures: detect, fence, abort the step in flight,
collect the survivors' accounts, plan (``controller.plan_recovery``), command, and account.

Detection, bounded:
- a crashed worker: its process exit is seen at the next poll (tens of milliseconds);
- a hung worker (stopped, wedged): its heartbeat counter stops moving. The step watchdog
  localizes it early: once no step was committed for ``stall_factor`` x the recent step time
  (at least ``stall_floor_s``), the workers silent for ``silence_beats`` heartbeat intervals
  (at least ``silence_floor_s``) while the others beat are the hung ones; judged only in
  steady state (``disrupted``). Otherwise, after ``heartbeat_timeout_s``, a silent worker
  is hung regardless (settings: ``HealthConfig``). A hung worker is *fenced*: killed with
  SIGKILL. gloo cannot cancel an operation and a stopped peer keeps its sockets open, so
  without fencing the survivors would wait for the group timeout; with it, a hang costs at
  most the heartbeat timeout;
- a failed collective (peer reset, a worker's own communicator aborted): the survivors
  report it; a worker whose own communicator failed is fenced and replaced.
Then the step in flight is aborted everywhere (``abort/<epoch>`` wakes every survivor out of
any wait, and the step's commit decision is set to ``abort`` unless it was already
``commit``), so no survivor is ever stuck past the bound. A survivor that still beats but
sends no report within ``recovery.report_timeout_s`` is fenced as hung.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from trainmover.control.errors import JobFailed
from trainmover.core import decisions as C
from trainmover.core import protocol as P
from trainmover.core.files import latest_complete
from trainmover.core.events import JsonlWriter
from trainmover.core.accounting import stalled_for


@dataclass
class Failure:
    worker: str
    kind: str            # crash | hang | commerr
    detected_at: float
    detail: str = ""


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
    reports: dict[str, dict] = field(default_factory=dict)
    replacements: list[str] = field(default_factory=list)   # processes started for it
    t_collect: float | None = None      # when collecting reports began (if not at detection)
    abandoned: list[int] = field(default_factory=list)      # ids of plans given up before


class Recovery:
    """Owned by the coordinator; ``poll`` is called on every supervision round."""

    def __init__(self, coord):
        self.coord = coord
        self.epoch = 0
        self.active: ActiveRecovery | None = None
        self.done: list[dict] = []
        self._beats: dict[str, tuple[tuple[int, int], float]] = {}  # (pid, count), seen at
        self._count = 0
        self.committed = -1           # last step whose decision is known to be commit
        self.failed_workers: set[str] = set()
        self._looked_at = 0.0
        # the step watchdog judges only a job in steady state: N commits after the last
        # change of processes or groups (a restarted or promoted process may spend a minute
        # compiling, starved of CPU, its heartbeat pausing: that is no hang)
        self._steady_since = time.time()

    def disrupted(self) -> None:
        """Processes or groups just changed (start, restart, promotion, switch, resume):
        the watchdog waits for the job to be back in steady state."""
        self._steady_since = time.time()

    @property
    def cfg(self):
        return self.coord.cfg

    # --- detection --------------------------------------------------------------------------
    def detect(self) -> list[Failure]:
        """New failures among the active workers (never the ones already being handled)."""
        coord, now = self.coord, time.time()
        handled = set(self.active.failures) if self.active else set()
        out = []
        # process exits every round; store look-ups (heartbeats, reports) less often
        look = now - self._looked_at >= self.cfg.health.check_interval_s
        if look:
            self._looked_at = now
        stalled = self.stalled_for(now) if look else None
        timeout = self._heartbeat_timeout_s()
        silent, beating = [], 0
        for w in list(coord.membership.workers):
            if w in handled or not coord.procs.known(w):
                continue
            code = coord.procs.exit_code(w)
            if code is not None and code != 0:
                out.append(Failure(w, "crash", now, f"exit code {code}"))
                continue
            if code == 0 or not look:
                continue
            if coord.store.check([P.finished_key(w)]):
                continue
            beat = self._beat(w)
            if beat is not None and now - beat > timeout:
                out.append(Failure(w, "hang", now, f"no heartbeat for {now - beat:.2f} s"))
                continue
            if beat is not None and now - beat > self.cfg.health.silence_s():
                silent.append((w, now - beat))
            elif beat is not None:
                beating += 1
            key = P.failure_key(self.epoch, w)
            if coord.store.check([key]):
                report = P.decode(coord.store.get(key))
                if report.get("self"):
                    out.append(Failure(w, "commerr", now, report.get("error", "")))
        if stalled is not None and silent and beating:
            for w, quiet in silent:
                out.append(Failure(w, "hang", now, f"silent for {quiet:.2f} s while the job "
                                                   f"made no progress for {stalled:.2f} s"))
        return out

    def _heartbeat_timeout_s(self) -> float:
        """The liveness timeout once the job committed a step since it last changed; the
        longer start-up timeout before that."""
        health = self.cfg.health
        records = self.coord.progress.records
        if records and records[-1]["time"] > self._steady_since:
            return health.heartbeat_timeout_s
        return health.startup_timeout_s

    def stalled_for(self, now: float) -> float | None:
        health = self.cfg.health
        times = [r["time"] for r in self.coord.progress.records[-11:]]
        return stalled_for([t for t in times if t > self._steady_since], now,
                           health.stall_factor, health.stall_floor_s)

    def _beat(self, worker: str) -> float | None:
        """Time the worker's heartbeat counter last moved (None before its first beat)."""
        store = self.coord.store
        pid = self.coord.procs.pid(worker)
        if pid is None:
            return None   # not started yet
        key = P.heartbeat_key(worker, pid)
        if not store.check([key]):
            return None
        count = store.add(key, 0)
        seen = self._beats.get(worker)
        if seen is None or seen[0] != (pid, count):
            self._beats[worker] = ((pid, count), time.time())
        return self._beats[worker][1]

    def fence(self, worker: str, why: str) -> None:
        """Kill a worker that is alive but failed: SIGCONT first is not needed, SIGKILL works
        on a stopped process, and closing its sockets turns a hang into a crash. Sent at
        once (not through the outbox): killing a failed process twice is harmless."""
        if self.coord.procs.running(worker):
            self.coord.procs.kill(worker)
        self.coord.events.emit("fenced", name=worker, reason=why)

    # --- the controller's snapshot -----------------------------------------------------------
    STATE = ("epoch", "active", "done", "_count", "committed", "failed_workers")

    def snapshot(self) -> dict:
        return {k: getattr(self, k) for k in self.STATE}

    def restore(self, state: dict) -> None:
        """A resumed controller: heartbeats are judged afresh (their timing was not kept)."""
        for k, v in state.items():
            setattr(self, k, v)

    # --- the state machine ------------------------------------------------------------------
    def poll(self) -> None:
        coord = self.coord
        self._advance_committed()
        new = self.detect()
        if new and self.active is None:
            self._start(new)
        elif new:
            # a failure while recovering: fence it too and go on with the wider set (a plan
            # already sent is abandoned: it counted on the worker that just failed)
            for f in new:
                self.fence(f.worker, f.kind)
                self.active.failures[f.worker] = f
            coord.events.emit("failure_during_recovery", workers=[f.worker for f in new])
            if self.active.state == "recovering":
                self._abandon(self.active, ", ".join(f"{f.worker} {f.kind}" for f in new))
        if self.active is not None:
            self._advance()

    def _advance_committed(self) -> None:
        store = self.coord.store
        while store.check([P.commit_key(self.epoch, self.committed + 1, "decision")]):
            if store.get(P.commit_key(self.epoch, self.committed + 1, "decision")) != b"commit":
                break
            self.committed += 1

    def _start(self, failures: list[Failure]) -> None:
        coord = self.coord
        if self.cfg.baseline.restart_on_failure:
            return self._restart_everything(failures)
        self._count += 1
        t = time.time()
        for f in failures:
            if f.kind != "crash":
                self.fence(f.worker, f.kind)
        reason = ", ".join(f"{f.worker} {f.kind} ({f.detail})" for f in failures)
        # the abort key goes out at once: the survivors are blocked until they see it, and a
        # resumed controller that repeats it writes the same key again
        coord.store.set(P.abort_key(self.epoch), reason)
        last = decide_abort(coord.store, self.epoch, self.committed + 1)
        self.committed = last
        self.active = ActiveRecovery(self._count, self.epoch, {f.worker: f for f in failures},
                                     t, last)
        coord.events.emit("failure_detected", recovery_id=self._count, epoch=self.epoch,
                          failures=[f.__dict__ for f in failures], last_committed_step=last)
        coord.progress.say(f"failure: {reason}; step {last + 1} aborted everywhere, "
                           f"last committed step {last}")
        if coord.active is not None:
            coord._settle_active(f"failure during the migration: {reason}")

    def _restart_everything(self, failures: list[Failure]) -> None:
        """The restart baseline for failures: stop every worker, start fresh processes from
        the newest complete checkpoint (what an elastic launcher does)."""
        coord = self.coord
        reason = ", ".join(f"{f.worker} {f.kind}" for f in failures)
        coord.events.emit("failure_detected", recovery_id=None, epoch=self.epoch,
                          failures=[f.__dict__ for f in failures], action="restart")
        for w in coord.membership.workers:
            self.fence(w, f"restart after {reason}")
        step = latest_complete(coord.run_dir)
        if step is None:
            raise JobFailed(f"{reason}: no complete checkpoint to restart from")
        coord._restart(step, cause=failures[0].kind)

    def _advance(self) -> None:
        rec = self.active
        coord = self.coord
        if rec.state == "collecting":
            survivors = [w for w in coord.membership.workers if w not in rec.failures]
            missing = []
            for w in survivors:
                key = P.failure_key(rec.epoch, w)
                if w not in rec.reports:
                    if coord.store.check([key]):
                        rec.reports[w] = P.decode(coord.store.get(key))
                    else:
                        missing.append(w)
            if missing:
                since = rec.t_collect or rec.t_detected
                if time.time() - since > self.cfg.recovery.report_timeout_s:
                    # alive (beating) yet silent: treat as failed too
                    for w in missing:
                        self.fence(w, "no report after abort")
                        rec.failures[w] = Failure(w, "hang", time.time(), "no report after abort")
                return
            self._plan(rec)
        elif rec.state == "recovering":
            dead = [j for j in rec.plan.joiners if coord.procs.exit_code(j) not in (None, 0)]
            if dead:
                self._abandon(rec, f"joiner {', '.join(dead)} died")
                return
            participants = set(rec.plan.joiners) | {w for w in coord.membership.workers
                                                    if w not in rec.failures}
            count = coord.store.add(P.recovery_key(rec.recovery_id, "recovered_count"), 0)
            if count >= len(participants):
                self._complete(rec)

    def _abandon(self, rec: ActiveRecovery, reason: str) -> None:
        """The plan sent for ``rec`` cannot complete (one of its joiners, or a survivor,
        failed). Its joiners are retired, the recovery's epoch is aborted, which wakes every
        survivor out of the group builds, transfers or step it is in, and a new recovery
        for the same failed roles starts collecting their reports in that epoch."""
        coord = self.coord
        for j in rec.plan.joiners:
            if coord.procs.running(j):
                coord.procs.kill(j)
            coord.membership.standbys[j] = C.StandbyState.DEAD
        coord.store.set(P.abort_key(self.epoch), f"recovery {rec.recovery_id} abandoned: "
                                                 f"{reason}")
        last = decide_abort(coord.store, self.epoch, self.committed + 1)
        self.committed = last
        coord.events.emit("recovery_abandoned", recovery_id=rec.recovery_id, reason=reason,
                          epoch=self.epoch)
        coord.progress.say(f"recovery {rec.recovery_id} abandoned ({reason}); planning again")
        self._count += 1
        self.active = ActiveRecovery(self._count, self.epoch, dict(rec.failures),
                                     rec.t_detected, last,
                                     replacements=rec.replacements, t_collect=time.time(),
                                     abandoned=rec.abandoned + [rec.recovery_id])

    def _plan(self, rec: ActiveRecovery) -> None:
        coord = self.coord
        m = coord.membership
        holders = {w: r for w, r in m.workers.items() if w not in rec.failures}
        dirty = C.dirty_groups(m.layout, {w: r["accounting"] for w, r in rec.reports.items()},
                               holders)
        ckpt = latest_complete(coord.run_dir)
        short = len(rec.failures) - len(m.free_standbys())
        if short > 0 and self.cfg.recovery.replace_without_standby:
            self._start_replacements(rec, short)
        try:
            plan = C.plan_recovery(m, rec.recovery_id, sorted(rec.failures), dirty, ckpt)
        except C.RecoveryImpossible as exc:
            raise JobFailed(f"cannot recover from {sorted(rec.failures)}: {exc}. Committed "
                            f"progress (step {rec.last_committed}) and checkpoints are intact.")
        rec.plan, rec.t_planned, rec.state = plan, time.time(), "recovering"
        self.disrupted()
        self._backfill_metrics(rec)
        coord.membership = C.reserve(coord.membership, plan)
        new_epoch = rec.epoch + 1
        resume = plan.rollback_step if plan.rollback_step is not None else rec.last_committed + 1
        rec.reports["resume_step"] = resume
        coord.events.emit("recovery_planned", epoch=new_epoch, resume_step=resume,
                          dirty_groups=sorted(dirty), **plan.describe())
        coord.progress.say(
            "recovery: " + ", ".join(f"{p.leaver} -> {p.joiner} ({p.role}, state from "
                                     f"{plan.sources[p.role.name]})" for p in plan.pairs)
            + f"; rebuilding {len(plan.generations)}/{plan.groups_total} groups; resuming at "
              f"step {resume}")
        senders = {}
        for p in plan.pairs:
            src = plan.sources[p.role.name]
            replica = src.split(":", 1)[1] if src.startswith("replica:") else None
            channel = f"rxfer.{replica}.{p.joiner}" if replica else None
            if replica:
                senders[replica] = P.SendState(p.joiner, channel, rec.recovery_id)
            coord.send(p.joiner, P.AssignRecovery(
                rec.recovery_id, p.role.name, new_epoch, resume,
                {s.name: plan.generations[s.name] for s in m.layout.groups_of(p.role).values()
                 if s.name in plan.generations},
                P.StateSource("replica", channel, rec.recovery_id) if channel
                else P.StateSource("checkpoint", step=plan.rollback_step)))
        for w in coord.membership.workers:
            if w in rec.failures:
                continue
            coord.send(w, P.Recover(
                rec.recovery_id, new_epoch, resume, plan.rollback_step,
                {g: plan.generations[g] for g in plan.stayers.get(w, [])}, senders.get(w)))
        self.epoch = new_epoch
        self.committed = resume - 1
        coord.controller_fault("recovery")

    def _start_replacements(self, rec: ActiveRecovery, count: int) -> None:
        """No free standby for every failed role: start new standby processes (on a cluster,
        on newly allocated machines). They take the assignment as soon as they run; until
        then the job waits, degraded. Nothing restarts: survivors keep their processes,
        state and clean groups."""
        coord = self.coord
        names = []
        for _ in range(count):
            name = f"s{coord._next_standby}"
            coord._next_standby += 1
            coord.membership.standbys[name] = C.StandbyState.STARTING
            coord._spawn(name, standby=True)
            names.append(name)
        rec.replacements.extend(names)
        coord.events.emit("degraded", recovery_id=rec.recovery_id, reason="no free standby",
                          replacements=names)
        coord.progress.say(f"no free standby for {', '.join(sorted(rec.failures))}: starting "
                           f"replacement {', '.join(names)}; the job waits for it (degraded)")

    def _backfill_metrics(self, rec: ActiveRecovery) -> None:
        """A reporter that died after its step was committed but before recording it: the
        record it left with its vote goes into metrics.jsonl, so every committed step has one."""
        coord = self.coord
        coord.progress.poll()
        step = rec.last_committed
        if step < 0 or any(r["step"] == step for r in coord.progress.records[-3:]):
            return
        key = P.commit_key(rec.epoch, step, "metrics")
        if coord.store.check([key]):
            record = P.decode(coord.store.get(key))
            # the step time the reporter had measured at its vote (its optimizer step, which
            # the record would include, never ran): close, flagged as backfilled
            record.update(step_time_s=round(record["step_time_s"], 6), backfilled=True)
            writer = JsonlWriter(os.path.join(coord.run_dir, "metrics.jsonl"))
            writer.write(record)
            writer.close()
            coord.events.emit("metrics_backfilled", step=step, worker=record["worker"])

    def _complete(self, rec: ActiveRecovery) -> None:
        coord = self.coord
        plan = rec.plan
        coord.membership = C.commit(coord.membership, C.MigrationPlan(
            rec.recovery_id, plan.pairs, plan.generations, plan.stayers, plan.groups_total))
        for p in plan.pairs:
            coord.put(P.membership_key(p.joiner), p.role.name)
        self.failed_workers |= set(rec.failures)
        rec.state = "done"
        self.disrupted()
        self.active = None
        coord.awaiting_recovery.append(rec)

    def report(self, rec: ActiveRecovery) -> dict:
        """Downtime from the fault to the first committed step after it (needs its metrics)."""
        coord = self.coord
        resume = rec.reports["resume_step"]
        t_commit = next((r["time"] for r in coord.progress.records if r["step"] == resume
                         and r["time"] > rec.t_detected), None)
        faults = [e for e in coord.fault_events() if e["worker"] in rec.failures]
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
        coord.events.emit("recovery_done", **result)
        if t_commit is not None:
            src = ", ".join(sorted(set(rec.plan.sources.values())))
            coord.progress.say(
                f"recovered from {', '.join(f'{w} {f.kind}' for w, f in rec.failures.items())}:"
                f" detection {max(detection.values()):.3f} s, downtime {result['downtime_s']:.3f}"
                f" s (fault to first committed step), state from {src}")
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
