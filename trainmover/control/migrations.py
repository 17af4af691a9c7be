"""The controller's driver for planned migrations: takes requests (API, CLI, injects, later
the straggler policy), plans them (``decisions.plan_migration``), sends the two phases'
commands, follows the participants' reports and accounts for each migration's downtime.

A migration moves through ``decisions.MigrationState``: PREPARING (stayers build the next
generation of the groups that contain the leaver, the joiner builds its role's groups and
registers its state; training goes on), SWITCHING (the controller said go; every participant
switches at one agreed step boundary), then DONE or ABORTED. One runs at a time; others wait
in ``pending``.
"""
from __future__ import annotations

import queue
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from trainmover.control.context import JobContext
from trainmover.control.migration_accounting import migration_result
from trainmover.control.retention import Retention
from trainmover.core import decisions as C
from trainmover.core import protocol as P
from trainmover.core.accounting import downtime_phrase


@dataclass
class MigrationRequest:
    workers: list[str]
    targets: list[str] | None = None
    source: str = "api"
    store_index: int | None = None          # set for requests from `trainmover migrate`
    future: Future = field(default_factory=Future)
    naive: bool = False
    # an API caller's future lives in the process that died; a resumed controller still
    # carries the request out (and answers store requests)
    __snapshot_exclude__ = ("future",)


@dataclass
class ActiveMigration:
    plan: C.MigrationPlan
    request: MigrationRequest
    state: C.MigrationState = C.MigrationState.PREPARING
    t_start: float = field(default_factory=time.time)
    t_go: float | None = None
    switch_step: int | None = None
    result: dict | None = None
    t_accountable: float | None = None   # the job passed the steps its downtime spans
    # joiners still starting or warming up when the migration started: its orders wait for
    # them (``standby.join_wait_s``), from t_start; then how long that took
    waiting_for: list = field(default_factory=list)
    warmup_wait_s: float = 0.0


class Migrations:
    STATE = ("pending", "active", "finished", "awaiting_downtime", "store_requests_seen",
             "keys_deleted")

    def __init__(self, ctx: JobContext, retention: Retention):
        self.ctx = ctx
        self.retention = retention
        self.requests: queue.Queue[MigrationRequest] = queue.Queue()   # from other threads
        self.pending: list[MigrationRequest] = []
        self.active: ActiveMigration | None = None
        self.finished: list[dict] = []
        self.awaiting_downtime: list[ActiveMigration] = []
        self.store_requests_seen = 0
        self._hole_since: dict[int, float] = {}   # request index -> first found missing
        self.keys_deleted: list[int] = []   # aborted migrations whose keys are deleted

    # --- requests ------------------------------------------------------------------------------
    def request(self, workers: list[str], targets: list[str] | None = None,
                naive: bool = False, source: str = "api") -> Future:
        """Thread-safe: queue a migration; the future gets its final result."""
        req = MigrationRequest(list(workers), list(targets) if targets else None, source,
                               naive=naive)
        self.requests.put(req)
        return req.future

    def submit(self, req: MigrationRequest) -> None:
        """From the controller's own thread (injects, policies)."""
        self.pending.append(req)

    def collect(self, from_store: bool = True) -> None:
        """Take the requests made through the API and, with ``from_store``, the store's."""
        ctx = self.ctx
        while True:
            try:
                self.pending.append(self.requests.get_nowait())
            except queue.Empty:
                break
        if not from_store:
            return
        count = ctx.store.add(P.REQUEST_COUNT_KEY, 0)
        while self.store_requests_seen < count:
            idx = self.store_requests_seen + 1
            raw = ctx.store.valid(P.request_key(idx))    # never a blocking get
            if raw is None:
                # not written yet (a client between taking the number and writing), or
                # never (a forged bump of the unsigned counter), or forged: waited for a
                # while, then passed over; the requests behind it are not held up longer
                since = self._hole_since.setdefault(idx, time.monotonic())
                if time.monotonic() - since < ctx.cfg.controller.request_hole_timeout_s:
                    break
                ctx.events.emit("request_skipped", key=P.request_key(idx))
                self._hole_since.pop(idx, None)
                self.store_requests_seen = idx
                continue
            self._hole_since.pop(idx, None)
            self.store_requests_seen = idx
            try:
                ask = P.read_message(P.MigrationAsk, raw)
            except P.MessageError as exc:
                ctx.events.emit("message_rejected", key=P.request_key(idx), error=str(exc))
                ctx.put(P.request_key(idx, "done"),
                        P.encode({"status": "refused", "reason": f"malformed request: {exc}"}))
                continue
            req = MigrationRequest(ask.workers, ask.to, ask.source, store_index=idx)
            self.pending.append(req)
            if self.active is not None or len(self.pending) > 1:
                self.answer(req, {"status": "queued",
                                  "reason": "another migration is in flight"}, final=False)

    def answer(self, req: MigrationRequest, result: dict, final: bool = True) -> None:
        if req.store_index is not None:
            self.ctx.put(P.request_key(req.store_index, "done" if final else "status"),
                         P.encode(result))
        if final and not req.future.done():
            req.future.set_result(result)

    def fail_all(self, exc: BaseException) -> None:
        reqs = self.pending + ([self.active.request] if self.active else [])
        for req in reqs:
            self.answer(req, {"status": "failed", "reason": str(exc)})

    # --- the state machine ---------------------------------------------------------------------
    def poll(self, start_new: bool = True) -> None:
        """One round: start the next pending migration (unless not ``start_new``: the job is
        stopping), or advance the one in flight."""
        if self.active is None and self.pending and start_new:
            self._start(self.pending.pop(0))
        if self.active is not None:
            self._advance()

    def _start(self, req: MigrationRequest) -> None:
        ctx = self.ctx
        mid = ctx.store.add(P.MIGRATION_COUNT_KEY, 1)
        targets = req.targets
        if req.naive and not targets:
            # the naive baseline starts a fresh process on the spot: a new standby name
            targets = [ctx.new_standby(C.StandbyState.COLD)]
        try:
            plan = C.plan_migration(ctx.membership, mid, req.workers, targets, set(),
                                    rebuild_all=req.naive)
        except C.MigrationRefused as exc:
            ctx.events.emit("migration_refused", migration_id=mid, workers=req.workers,
                            reason=str(exc), source=req.source)
            ctx.progress.say(f"migration of {', '.join(req.workers)} refused: {exc}")
            self.answer(req, {"status": "refused", "reason": str(exc)})
            return
        joiner_states = {p.joiner: ctx.membership.standbys[p.joiner] for p in plan.pairs}
        ctx.membership = C.reserve(ctx.membership, plan)
        mig = ActiveMigration(plan, req)
        self.active = mig
        info = plan.describe()
        ctx.events.emit("migration_started", source=req.source, naive=req.naive, **info)
        ctx.progress.say(
            f"migration {mid}: " + ", ".join(f"{p.leaver} -> {p.joiner} ({p.role})"
                                             for p in plan.pairs) +
            f"; rebuilding {info['groups_rebuilt']}/{info['groups_total']} groups"
            + (" [naive]" if req.naive else ""))
        self.answer(req, {"status": "started", **info}, final=False)
        if not req.naive and ctx.cfg.standby.join_wait_s > 0:
            mig.waiting_for = [p.joiner for p in plan.pairs if joiner_states[p.joiner] in
                               (C.StandbyState.STARTING, C.StandbyState.WARMING)]
        if mig.waiting_for:
            # ordered now, a standby drops its warm-up: its first real steps would compile
            # and warm up inside the switch, while every stayer waits
            ctx.events.emit("migration_waiting", migration_id=mid, joiners=mig.waiting_for,
                            states=[joiner_states[j].value for j in mig.waiting_for],
                            limit_s=ctx.cfg.standby.join_wait_s)
            ctx.progress.say(f"migration {mid} waits for {', '.join(mig.waiting_for)} to "
                             f"finish warming up (at most {ctx.cfg.standby.join_wait_s:g} s)")
            return
        self._order(mig)

    def _order(self, mig: ActiveMigration) -> None:
        """Phase 1's orders to every participant (the naive baseline's switch at once)."""
        ctx, plan, req = self.ctx, mig.plan, mig.request
        mid = plan.migration_id
        for stayer, groups in plan.stayers.items():
            ctx.send(stayer, P.Prepare(mid, {g: plan.generations[g] for g in groups},
                                       naive=req.naive))
        for pair in plan.pairs:
            ctx.send(pair.leaver, P.Leave(mid, pair.joiner, pair.transfer_group, mid,
                                          naive=req.naive))
            role_groups = ctx.cfg.layout.groups_of(pair.role)
            ctx.send(pair.joiner, P.AssignMigration(
                mid, pair.role.name, ctx.epoch, pair.leaver, pair.transfer_group, mid,
                {s.name: plan.generations[s.name] for s in role_groups.values()
                 if s.name in plan.generations}, naive=req.naive))
        if req.naive:
            # no preparation phase: the switch is ordered at once, the joiner starts cold
            # when the leaver reaches the switch boundary
            self._go(mig)
        ctx.reached("migration_prepare")

    def _go(self, mig: ActiveMigration) -> None:
        self.ctx.disrupted()
        mig.state, mig.t_go = C.MigrationState.SWITCHING, time.time()
        self.ctx.put(P.mig_key(mig.plan.migration_id, "go"), "1")
        self.ctx.events.emit("migration_go", migration_id=mig.plan.migration_id)
        self.ctx.reached("migration_switch")

    def joiners_past_switch(self) -> list[str]:
        """The joiners of the active migration whose leavers reached the switch (the
        leaver's state went to the joiner, and the leaver left)."""
        mig = self.active
        if mig is None:
            return []
        mid = mig.plan.migration_id
        # signed: an at_switch value planted by someone else would keep the job from ending
        return [p.joiner for p in mig.plan.pairs
                if self.ctx.store.valid(P.mig_key(mid, "at_switch", p.leaver)) is not None]

    def all_switched(self) -> bool:
        mig = self.active
        count = self.ctx.store.add(P.mig_key(mig.plan.migration_id, "switched_count"), 0)
        return count >= len(mig.plan.participants)

    def _advance(self) -> None:
        ctx, mig = self.ctx, self.active
        plan, mid = mig.plan, mig.plan.migration_id
        if mig.request.naive:
            # the naive baseline starts its joiner once the leaver is at the switch: signed,
            # or a planted at_switch value would start it early (the leaver still training)
            for pair in plan.pairs:
                if not ctx.procs.known(pair.joiner) and \
                        ctx.store.valid(P.mig_key(mid, "at_switch", pair.leaver)) is not None:
                    ctx.spawn(pair.joiner, standby=True)
        dead = {j for j in plan.joiners
                if ctx.procs.known(j) and ctx.procs.exit_code(j) not in (None, 0)}
        if mig.waiting_for and not (dead or self._warmed_up(mig)):
            return
        participants = set(plan.participants)
        ready = participants if mig.state is not C.MigrationState.PREPARING else \
            (participants if ctx.store.add(P.mig_key(mid, "ready_count"), 0) >= len(participants)
             else set())
        switched = participants if self.all_switched() else set()
        state, why = C.next_state(mig.state, ready=ready, switched=switched,
                                  participants=participants, dead=dead,
                                  joiners=set(plan.joiners))
        if state is mig.state:
            if dead and mig.state is C.MigrationState.SWITCHING:
                self._joiner_died_at_switch(sorted(dead))
            return
        if state is C.MigrationState.SWITCHING:
            self._go(mig)
        elif state is C.MigrationState.ABORTED:
            self.abort(why, dead)
        elif state is C.MigrationState.DONE:
            self._complete(mig)

    def _warmed_up(self, mig: ActiveMigration) -> bool:
        """Whether the joiners the migration waits for are done warming up (warm, or cold
        for good) or ``standby.join_wait_s`` passed; if so, the orders go out now."""
        ctx, mid = self.ctx, mig.plan.migration_id
        states = {}
        for j in mig.waiting_for:
            report = ctx.read(P.StandbyReport, P.standby_state_key(j))
            states[j] = report.state if report is not None else "starting"
        busy = [j for j, st in states.items() if st in ("starting", "warming")]
        waited = time.time() - mig.t_start
        if busy and waited < ctx.cfg.standby.join_wait_s:
            return False
        mig.waiting_for, mig.warmup_wait_s = [], waited
        ctx.events.emit("migration_waited", migration_id=mid, waited_s=round(waited, 3),
                        states=states, timed_out=bool(busy),
                        level="warning" if busy else "info")
        if busy:
            ctx.progress.say(f"migration {mid}: {', '.join(busy)} still warming up after "
                             f"{waited:.0f} s (standby.join_wait_s): ordered in anyway")
        self._order(mig)
        return False     # the orders just went out: nobody is ready yet

    def abort(self, reason: str, dead: set[str] = frozenset()) -> None:
        """Give up the migration in flight; the job goes on unchanged."""
        ctx, mig = self.ctx, self.active
        mid = mig.plan.migration_id
        ctx.put(P.mig_key(mid, "abort"), reason)
        ctx.membership = C.abort(ctx.membership, mig.plan, set(dead))
        for j in mig.plan.joiners:
            if j not in dead and ctx.procs.running(j):
                ctx.retire(j)
        ctx.events.emit("migration_aborted", migration_id=mid, reason=reason)
        ctx.progress.say(f"migration {mid} aborted: {reason}; the job continues unchanged")
        result = {"status": "aborted", "reason": reason, **mig.plan.describe(),
                  "source": mig.request.source}
        self.finished.append(result)
        self.answer(mig.request, result)
        self.active = None

    def _joiner_died_at_switch(self, dead: list[str]) -> None:
        """A joiner died after the switch was ordered. Its pair is settled like any pair a
        failure interrupts: if its leaver had handed the state over, the dead joiner holds
        the role and the recovery (which sees it dead) restores the role from its usual
        source. If not, the leaver keeps its role, but stayers may already have switched to
        groups that include the dead joiner (a stayer can pass the switch boundary while
        this runs): the leaver is fenced too, so that one recovery rebuilds that role's
        groups for everyone, whichever side of the boundary each stayer is on."""
        ctx, mid = self.ctx, self.active.plan.migration_id
        reason = f"joiner {', '.join(dead)} died during the switch of migration {mid}"
        ctx.events.emit("joiner_died_at_switch", migration_id=mid, joiners=dead)
        for leaver in self.settle(reason):
            ctx.fence(leaver, f"its migration's joiner died at the switch (migration {mid})")

    def settle(self, reason: str) -> list[str]:
        """A failure interrupted the migration in flight (if any): pairs whose state already
        moved are committed (their joiners now take part in the recovery as role holders),
        the others are abandoned. Returns the leavers of the abandoned pairs (still their
        roles' holders)."""
        if self.active is None:
            return []
        ctx, mig = self.ctx, self.active
        plan, mid = mig.plan, mig.plan.migration_id
        # per pair, the leaver's "handover" and this "abort" race on one compare-and-set
        handed = {p.leaver for p in plan.pairs
                  if ctx.store.compare_set(P.mig_key(mid, "outcome", p.leaver), "",
                                           "abort") == b"handover"}
        if not handed:
            self.abort(reason)
            return [p.leaver for p in plan.pairs]
        ctx.membership, done, rest = C.settle_on_failure(ctx.membership, plan, handed)
        for p in done:
            ctx.put(P.membership_key(p.joiner), p.role.name)
        for p in rest:
            if ctx.procs.running(p.joiner):
                ctx.retire(p.joiner)
        ctx.put(P.mig_key(mid, "abort"), reason)   # participants still preparing drop it
        result = {"status": "interrupted", "reason": reason, **plan.describe(),
                  "source": mig.request.source,
                  "committed_pairs": [p.leaver for p in done],
                  "abandoned_pairs": [p.leaver for p in rest]}
        ctx.events.emit("migration_interrupted", **result)
        ctx.progress.say(f"migration {mid} interrupted by a failure: "
                         + ", ".join(f"{p.leaver} -> {p.joiner} kept (state already moved)"
                                     for p in done)
                         + "".join(f"; {p.leaver} -> {p.joiner} abandoned" for p in rest))
        self.finished.append(result)
        self.answer(mig.request, result)
        self.active = None
        return [p.leaver for p in rest]

    def job_finished(self) -> None:
        """Every role holder finished: complete a migration that switched in the same round,
        or abort one whose switch boundary the job never reached."""
        if self.active is None:
            return
        if self.all_switched():
            self._complete(self.active)
        else:
            self.abort("the job finished before the switch step")

    def _complete(self, mig: ActiveMigration) -> None:
        ctx = self.ctx
        ctx.disrupted()
        plan, mid = mig.plan, mig.plan.migration_id
        ctx.membership = C.commit(ctx.membership, plan)
        for p in plan.pairs:
            ctx.put(P.membership_key(p.joiner), p.role.name)
        agreed = ctx.store.valid(P.mig_key(mid, "switch_at"))
        # forged after the workers agreed (they replace a forged value before): the switch
        # was at the boundary just passed, as far as accounting goes
        mig.switch_step = int(agreed) if agreed is not None else ctx.progress.last_step + 1
        mig.state = C.MigrationState.DONE
        self.active = None
        self.awaiting_downtime.append(mig)

    # --- accounting ----------------------------------------------------------------------------
    def finish_downtimes(self, final: bool = False) -> None:
        """A migration's downtime is known once the job committed the steps it spans and
        every stayer posted its step-end times (``P.StepEnds``); after
        ``controller.downtime_report_timeout_s`` without them (a stayer died or is slow) it
        is measured from the ones there are, and at the job's end from what there is."""
        ctx = self.ctx
        for mig in list(self.awaiting_downtime):
            if not final:
                if ctx.progress.last_step < mig.switch_step + P.DOWNTIME_STEPS_AFTER:
                    continue
                keys = [P.mig_key(mig.plan.migration_id, "steps", w) for w in mig.plan.stayers]
                if not ctx.store.check(keys):
                    mig.t_accountable = mig.t_accountable or time.time()
                    if time.time() - mig.t_accountable < \
                            ctx.cfg.controller.downtime_report_timeout_s:
                        continue
            self.awaiting_downtime.remove(mig)
            self._report(mig)

    def _report(self, mig: ActiveMigration) -> None:
        ctx = self.ctx
        plan, mid = mig.plan, mig.plan.migration_id
        result = migration_result(ctx, mig)
        downtime, noise, phases = result["downtime_s"], result["downtime_noise_s"], \
            result["phases"]
        self.finished.append(result)
        ctx.events.emit("migration_done", **result)
        self.retention.migration_accounted(mid, list(plan.participants),
                                           [p.leaver for p in plan.pairs],
                                           [(p.transfer_group, mid) for p in plan.pairs])
        # the keys of migrations given up before this one: their participants moved on
        for old in self.finished:
            if old.get("status") in ("aborted", "interrupted") and \
                    old["migration_id"] not in self.keys_deleted:
                self.keys_deleted.append(old["migration_id"])
                leavers = [p["leaver"] for p in old["pairs"]]
                joiners = [p["joiner"] for p in old["pairs"]]
                self.retention.migration_done(old["migration_id"],
                                              old["stayers"] + leavers + joiners, leavers)
        if downtime is not None:
            step_s = phases["normal_train_step_s"]
            ctx.progress.say(   # the downtime worded as everywhere (core/accounting.py)
                f"migration {mid} done at step {mig.switch_step}: "
                f"{downtime_phrase(downtime, noise)} "
                f"(transfer {phases['transfer_s']:.3f} s, group switch "
                f"{phases['group_switch_s']:.3f} s, joiner's first step "
                f"{phases['first_step_s']:.3f} s"
                + (f" vs a normal step's {step_s:.3f} s" if step_s is not None else "") + "); "
                f"{result['groups_rebuilt']}/{result['groups_total']} groups rebuilt")
        self.answer(mig.request, result)
