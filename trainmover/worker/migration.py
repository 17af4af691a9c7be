"""A worker's whole side of a planned migration: stayer, leaver and joiner.

Phase 1 (``prepare``): a stayer's background thread, with its own store client, builds the
next generation of its affected groups while the main thread keeps training on the current
ones; the leaver builds its channel to the joiner the same way; the joiner (a standby) builds
the role's groups and the channel, then the training script builds its model and registers
its state. Phase 2 (the switch): at the agreed boundary the stayers install the new groups,
the leaver hands its state to the joiner and leaves, and the joiner trains from the step the
state belongs to. Nothing here runs inside a step.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

from trainmover.core import protocol as P
from trainmover.core.proc import rss_mb
from trainmover.comm.groups import CommGroups, Group, GroupBuilder, StoreClients
from trainmover.core.events import EventLog
from trainmover.core.topology import GroupSpec, Layout, Role
from trainmover.train import precopy as PC
from trainmover.train.transfer import post_layout, recv_layout, recv_state, send_state
from trainmover.worker.commands import CommandChannel

def transfer_spec(name: str, role: Role) -> GroupSpec:
    """The leaver/joiner channel: both hold the same role; the leaver is rank 0.

    The channel is built not ``abortable``: once the leaver claimed the handover, the role
    is the joiner's, and a failure elsewhere in the job (which aborts the epoch) must not
    stop the state on its way, or the role would be lost with both of its holders alive.
    A transfer ends by completing, or when the leaver or the joiner dies."""
    return GroupSpec(name, "xfer", (role, role))


@dataclass
class Participation:
    """One migration as seen by one worker."""

    migration_id: int
    kind: str                          # "stayer" | "leaver"
    command: P.Prepare | P.Leave
    built: dict[str, Group] = field(default_factory=dict)
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    reported_ready: bool = False
    dropped: bool = False
    switch_at: int | None = None
    prepare_step: int = 0              # the boundary at which phase 1 began here
    t_go: float | None = None
    build_s: float = 0.0
    rss_before: dict = field(default_factory=dict)
    layout_sent: list | None = None    # a leaver's posted layout: ``post_layout``'s works
    precopy: PC.PrecopySender | None = None   # a leaver's pre-copy (``migration.precopy``)


LEAVE = "leave"
STOP = "stop"


class Migrations:
    """A stayer's or leaver's migrations; ``at_boundary`` is called before each step."""

    def __init__(self, name: str, role: Role, layout: Layout, groups: CommGroups,
                 builder: GroupBuilder, stores: StoreClients, commands: CommandChannel,
                 events: EventLog):
        self.name, self.role, self.layout, self.groups = name, role, layout, groups
        self.builder, self.stores, self.commands, self.events = builder, stores, commands, events
        self.store = stores.get()
        self.active: dict[int, Participation] = {}
        self.retired: list[Group] = []
        self.state = None   # the registered TrainState (what a leaver hands over)
        self.settings = None   # the job's MigrationConfig (pre-copy)
        self.pending_check = None   # a joiner's PrecopyCheck, until its first vote
        self.on_point = lambda point, step: None   # fault injection (faults.hit)
        self.stop_at: int | None = None   # a graceful stop's agreed step
        # when each recent step ended here (wall clock), and the switches whose step-end
        # times are still to be posted (migration id, prepare step, switch step)
        self.step_ends: dict[int, float] = {}
        self.timing_due: list[tuple[int, int, int]] = []

    def step_ended(self, step: int, at: float | None = None) -> None:
        """The loop finished ``step`` (committed and applied). A step redone after a
        recovery overwrites its earlier end."""
        self.step_ends.pop(step, None)
        self.step_ends[step] = time.time() if at is None else at
        while len(self.step_ends) > P.STEP_END_HISTORY:
            del self.step_ends[next(iter(self.step_ends))]

    # --- the per-step hook ---------------------------------------------------------------
    def at_boundary(self, step: int) -> str | None:
        if self.retired:
            # closing a gloo group joins its threads (tens of ms): do it beside training
            retired, self.retired = self.retired, []
            threading.Thread(target=lambda: [g.shutdown() for g in retired], daemon=True,
                             name="retire-groups").start()
        for cmd in self.commands.poll():
            self._accept(cmd, step)
        if self.timing_due:
            self._post_step_ends(step)
        if self.stop_at is not None and step >= self.stop_at:
            if step > self.stop_at:
                raise RuntimeError(f"{self.name} is at step {step}, past the agreed stop "
                                   f"step {self.stop_at}")
            return STOP
        if not self.active:
            return None  # the common case: one queue look-up, nothing else
        for mid in list(self.active):
            part = self.active[mid]
            outcome = self._advance(part, step)
            if outcome == LEAVE:
                return LEAVE
        return None

    # --- commands ------------------------------------------------------------------------
    def _accept(self, cmd: P.Command, step: int) -> None:
        if isinstance(cmd, P.Stop):
            # the same agreement as a switch step: the first proposal wins, a margin ahead
            proposal = str(step + P.SWITCH_MARGIN_STEPS)
            self.stop_at = int(self.store.compare_set(P.stop_step_key(cmd.stop_id), "",
                                                      proposal))
            self.events.emit("stop_accepted", stop_id=cmd.stop_id, stop_step=self.stop_at,
                             step=step)
            return
        if not isinstance(cmd, (P.Prepare, P.Leave)):
            self.events.emit("command_dropped", command=type(cmd).__name__,
                             reason="not a command for an active worker", level="warning")
            return
        mid = cmd.migration_id
        part = Participation(mid, "stayer" if isinstance(cmd, P.Prepare) else "leaver", cmd,
                             prepare_step=step, rss_before=rss_mb())
        self.active[mid] = part
        self.events.emit("migration_prepare", migration_id=mid, part=part.kind,
                         groups=cmd.groups if isinstance(cmd, P.Prepare) else {},
                         naive=cmd.naive)
        self.on_point("prepare", step)
        if cmd.naive:
            part.done.set()  # the naive baseline prepares nothing ahead: all of it at the switch
            return
        threading.Thread(target=self._build, args=(part,), daemon=True,
                         name=f"prepare-{mid}").start()

    def _specs(self, part: Participation) -> list[tuple[GroupSpec, int, Role]]:
        """(spec, generation, my role in it) of every group this worker builds."""
        cmd = part.command
        if part.kind == "leaver":
            return [(transfer_spec(cmd.transfer_group, self.role), cmd.transfer_generation,
                     self.role)]
        # each group by its name: O(its size), where building every group of the layout
        # cost each stayer O(N) per migration
        return [(self.layout.group(n), g, self.role) for n, g in sorted(cmd.groups.items())]

    def _build(self, part: Participation) -> None:
        """Phase 1 in a background thread; the builder gives this thread its own store client."""
        t0 = time.perf_counter()
        try:
            for spec, gen, role in self._specs(part):
                group = self._build_one(spec, role, gen, part)
                if part.dropped:  # abandoned while we waited: close what we made
                    group.shutdown()
                    continue
                part.built[spec.name] = group
        except BaseException as exc:  # noqa: BLE001 - reported at the next boundary
            part.error = exc
        part.build_s = time.perf_counter() - t0
        part.done.set()

    def _build_one(self, spec: GroupSpec, role: Role, gen: int, part: Participation) -> Group:
        if spec.kind == "xfer":
            return self.builder.build_ranked(spec, 0 if part.kind == "leaver" else 1, gen,
                                             abortable=False)   # see transfer_spec
        return self.builder.build(spec, role, gen)

    # --- progress of one migration ---------------------------------------------------------
    def _advance(self, part: Participation, step: int) -> str | None:
        mid = part.migration_id
        store = self.store
        reason = store.valid(P.mig_key(mid, "abort"))       # a forged one is ignored
        if reason is not None:
            self._drop(part, reason.decode())
            return None
        if not part.done.is_set():
            return None
        if part.error is not None:
            err = part.error
            self._drop(part, f"phase 1 failed: {err}")
            raise RuntimeError(f"migration {mid}: preparing groups failed on {self.name}: {err}")
        if part.kind == "leaver" and part.layout_sent is None and \
                part.command.transfer_group in part.built:
            channel = part.built[part.command.transfer_group]
            part.precopy = self._precopy(part, channel)
            part.layout_sent = post_layout(self.state, channel, 1,
                                           precopy=part.precopy is not None)
        if part.precopy is not None:
            part.precopy.at_boundary(step)
            if not part.precopy.copied:
                return None    # ready once the joiner holds every parameter
        if not part.reported_ready:
            part.reported_ready = True
            store.set(P.mig_key(mid, "ready", self.name),
                      P.write_message(P.ReadyReport(part.build_s, step=step)))
            store.add(P.mig_key(mid, "ready_count"), 1)
        if part.switch_at is None:
            if not store.check([P.mig_key(mid, "go")]):
                return None
            part.t_go = part.t_go or time.perf_counter()
            proposal = str(step + P.SWITCH_MARGIN_STEPS)
            part.switch_at = int(store.compare_set(P.mig_key(mid, "switch_at"), "", proposal))
        if step < part.switch_at:
            return None
        if step > part.switch_at:
            raise RuntimeError(f"migration {mid}: {self.name} is at step {step}, past the switch "
                               f"step {part.switch_at}")
        return self._switch(part, step)

    def _switch(self, part: Participation, step: int) -> str | None:
        """Phase 2, at the agreed boundary: every collective of the previous step has
        completed (train_step waits for all its work), so the old groups are quiet."""
        mid, cmd = part.migration_id, part.command
        self.on_point("switch", step)
        t0 = time.perf_counter()
        report = {"wait_boundary_s": t0 - (part.t_go or t0), "build_s": part.build_s,
                  "rss_before": part.rss_before}
        if part.kind == "leaver":
            # the point of no return, decided once: the controller claims "abort" the same
            # way when a failure interrupts the migration, and only one of us can win
            outcome = self.store.compare_set(P.mig_key(mid, "outcome", self.name), "",
                                             "handover").decode()
            if outcome != "handover":
                self._drop(part, "a failure interrupted the migration before the handover")
                return None   # still this role's holder: recovery treats us as a survivor
            self.store.set(P.mig_key(mid, "at_switch", self.name), str(step))
            if cmd.naive:
                spec, gen, role = self._specs(part)[0]
                part.built[spec.name] = self._build_one(spec, role, gen, part)
            channel = part.built[cmd.transfer_group]
            if part.layout_sent is None:      # the naive baseline builds it only now
                part.layout_sent = post_layout(self.state, channel, 1)
            for work, _ in part.layout_sent:
                work.wait()
            held = part.precopy.finish() if part.precopy is not None else frozenset()
            sent = send_state(self.state, channel, 1, step, skip_params=held)
            report.update(transfer_s=sent["seconds"], transfer_bytes=sent["bytes"])
            if part.precopy is not None:
                report.update(part.precopy.report())
            if held:
                # after the transfer, off the switch's path: what the joiner's replayed copy
                # must equal (it checks before its first optimizer step)
                self.store.set(P.mig_key(mid, "precopy_sums", self.role.name),
                               P.encode(PC.checksums(self.state, held)))
            channel.shutdown()
            self.groups.shutdown()
        else:
            if cmd.naive:
                tb = time.perf_counter()
                for spec, gen, role in self._specs(part):
                    part.built[spec.name] = self._build_one(spec, role, gen, part)
                report["build_s"] = time.perf_counter() - tb
            ti = time.perf_counter()
            # the replaced groups are closed at the next boundary, off the critical path;
            # nothing can use them any more: every holder reads the new slots
            self.retired.extend(self.groups.install(part.built))
            report["install_s"] = time.perf_counter() - ti
            self.timing_due.append((mid, part.prepare_step, step))
        report["switch_s"] = time.perf_counter() - t0
        report["rss_after"] = rss_mb()
        self.store.set(P.mig_key(mid, "switched", self.name),
                       P.write_message(P.SwitchReport(**report)))
        self.store.add(P.mig_key(mid, "switched_count"), 1)
        self.events.emit("migration_switched", migration_id=mid, step=step, part=part.kind,
                         **{k: v for k, v in report.items()
                            if k.endswith("_s") or k.startswith(("transfer_", "precopy_"))})
        del self.active[mid]
        return LEAVE if part.kind == "leaver" else None

    def _precopy(self, part: Participation, channel: Group) -> PC.PrecopySender | None:
        """A leaver's pre-copy, when the job asks for it and the state can be replayed."""
        cfg = self.settings
        if cfg is None or not cfg.precopy or part.command.naive:
            return None
        why = PC.refusal(self.state)
        if why is not None:
            self.events.emit("precopy_refused", migration_id=part.migration_id, reason=why,
                             level="warning")
            return None
        return PC.PrecopySender(
            self.state, channel, 1, int(cfg.precopy_chunk_mb * 2**20), cfg.precopy_max_wait,
            emit=lambda event, **f: self.events.emit(event, migration_id=part.migration_id,
                                                     **f))

    def before_optimizer(self, step: int, args, kwargs) -> None:
        """A committed step's optimizer is about to run (the registered optimizer's
        pre-hook): a pre-copying leaver sends the gradients it applies."""
        for part in self.active.values():
            if part.precopy is not None:
                part.precopy.before_optimizer(step, args, kwargs)

    def _post_step_ends(self, step: int) -> None:
        """Once the steps through ``DOWNTIME_STEPS_AFTER`` past a switch have ended, post
        their end times, from the baseline steps before phase 1 on (``P.StepEnds``)."""
        for due in list(self.timing_due):
            mid, prepare, switch = due
            last = switch + P.DOWNTIME_STEPS_AFTER
            if step <= last:
                continue
            self.timing_due.remove(due)
            first = max(prepare - P.DOWNTIME_BASELINE_STEPS - 1, switch - P.STEP_END_HISTORY)
            while first not in self.step_ends and first < switch:
                first += 1   # the job (or this role's tenure) began later
            ends = [self.step_ends.get(s) for s in range(first, last + 1)]
            if None in ends:
                continue   # a recovery redid part of it: no clean account
            self.store.set(P.mig_key(mid, "steps", self.name), P.write_message(
                P.StepEnds(first, prepare, switch, ends)))

    def _drop(self, part: Participation, reason: str) -> None:
        """Abandon a migration: the live groups were never touched; prepared ones are closed
        (a builder still waiting for a dead joiner closes its group when it gives up)."""
        part.dropped = True
        for g in list(part.built.values()):
            g.shutdown()
        if self.state is not None:
            self.state.release_view()   # taken for the switch in phase 1 (post_layout)
        self.events.emit("migration_dropped", migration_id=part.migration_id, reason=reason)
        del self.active[part.migration_id]


# --- the joiner ----------------------------------------------------------------------------------

def joiner_build(builder: GroupBuilder, layout: Layout, role: Role, command: P.AssignMigration
                 ) -> tuple[CommGroups, Group, float]:
    """Phase 1 of a joiner: build the role's groups at the generations the migration gives
    and the channel from the leaver, in the one global name order every participant uses.
    Returns the groups, the channel and the seconds taken."""
    t0 = time.perf_counter()
    gens = command.groups
    specs = layout.groups_of(role)
    built = {}
    todo = sorted([(s.name, s) for s in specs.values()] +
                  [(command.transfer_group, transfer_spec(command.transfer_group, role))])
    for name, spec in todo:
        if spec.kind == "xfer":
            built[name] = builder.build_ranked(spec, 1, command.transfer_generation,
                                               abortable=False)
        else:
            built[name] = builder.build(spec, role, gens.get(name, 0))
    channel = built.pop(command.transfer_group)
    return CommGroups.from_groups(role, layout, built), channel, time.perf_counter() - t0


def joiner_allocate(state, channel: Group, events: EventLog, migration_id: int) -> bool:
    """Phase 1, once the script registered its state: the optimizer state entries the
    leaver's layout names (``recv_layout``), allocated before the switch. A leaver gone or
    a migration dropped meanwhile closes the channel: reported, and left to the switch
    (which fails the same way) and the controller. Returns whether the leaver pre-copies."""
    try:
        got = recv_layout(state, channel, 0)
    except Exception as exc:  # noqa: BLE001 - phase 1 of a migration that will not happen
        events.emit("optimizer_state_not_allocated", migration_id=migration_id,
                    error=str(exc)[:300], level="warning")
        return False
    events.emit("optimizer_state_allocated", migration_id=migration_id, bytes=got["bytes"],
                seconds=round(got["seconds"], 4), precopy=got["precopy"])
    return got["precopy"]


def joiner_ready(store, events: EventLog, name: str, migration_id: int, build_s: float,
                 prepare_s: float) -> None:
    """Phase 1 is done once the script registered its state: the role's groups exist and its
    model and optimizer are built; the switch can be ordered."""
    store.set(P.mig_key(migration_id, "ready", name),
              P.write_message(P.ReadyReport(build_s, prepare_s=prepare_s)))
    store.add(P.mig_key(migration_id, "ready_count"), 1)
    events.emit("joiner_ready", migration_id=migration_id, build_s=round(build_s, 4),
                prepare_s=round(prepare_s, 4))


def joiner_receive(state, channel: Group, precopy: bool = False,
                   on_replay=lambda step: None) -> tuple[int, dict, frozenset[str]]:
    """Phase 2: the leaver sends its state at the switch boundary; that step is ours next.
    With ``precopy`` (the leaver said so in phase 1), first the pre-copy: chunks of the state
    and the leaver's optimizer steps, replayed here, until the switch's header. Returns the
    step, the report and the parameters the replay kept current (to be checked)."""
    t0 = time.perf_counter()
    held, replayed, slack = frozenset(), 0, None
    if precopy:
        receiver = PC.PrecopyReceiver(state, channel, 0, on_replay)
        held = receiver.run()
        replayed, slack = receiver.steps, receiver.slack_s()
    t1 = time.perf_counter()
    start_step, got = recv_state(state, channel, 0, skip_params=held)
    channel.shutdown()
    report = {"recv_s": time.perf_counter() - t0, "transfer_s": got["seconds"],
              "transfer_bytes": got["bytes"]}
    if precopy:
        # the switch's own part: from the leaver's header to the state complete
        report.update(precopy_steps=replayed, precopy_s=t1 - t0,
                      switch_recv_s=time.perf_counter() - t1, precopy_slack_s=slack)
    return start_step, report, held


class PrecopyDiverged(RuntimeError):
    """The joiner's replayed copy differs from the leaver's state: the script changes
    registered state outside the optimizer (``MigrationConfig``)."""


class PrecopyCheck:
    """The joiner's check of its replayed copy against the leaver's checksums, before it
    votes on its first step (``StepLoop.vote_on``): a copy that differs must not commit a
    step whose gradients it took part in, so the joiner fails before the vote and the step
    is aborted everywhere. Its own checksums are taken in a thread meanwhile (nothing it
    sums changes before that step's optimizer)."""

    def __init__(self, state, held: frozenset[str], store, key: str, events: EventLog,
                 timeout_s: float):
        self.store, self.key, self.events, self.timeout_s = store, key, events, timeout_s
        self._mine: list = []
        self._thread = threading.Thread(
            target=lambda: self._mine.append(PC.checksums(state, held)), daemon=True,
            name="precopy-check")
        self._thread.start()

    def __call__(self) -> None:
        self._thread.join()
        try:
            self.store.raw.wait([self.key], timedelta(seconds=self.timeout_s))
        except Exception:  # noqa: BLE001 - not there in time: judged below
            pass
        raw = self.store.valid(self.key)
        if raw is None or not self._mine:
            self.events.emit("precopy_unverified", level="warning",
                             reason="the leaver's checksums did not come" if raw is None
                             else "this copy's checksums failed")
            return
        mine, theirs = self._mine[0], json.loads(raw)
        bad = PC.first_difference(mine, theirs)
        if bad is not None:
            self.events.emit("precopy_diverged", entry=bad, level="error")
            raise PrecopyDiverged(
                f"pre-copy: the replayed copy of {bad!r} differs from the leaver's: the "
                f"script changes registered state outside the optimizer's step(), which a "
                f"pre-copy cannot follow (set migration.precopy = false for it); this role "
                f"is recovered like any failed worker's")
        self.events.emit("precopy_verified", entries=len(mine))


def joiner_started(store, events: EventLog, name: str, migration_id: int, report: dict,
                   start_step: int, first_step_s: float) -> None:
    report = {**report, "first_step_s": first_step_s, "rss_after": rss_mb()}
    store.set(P.mig_key(migration_id, "switched", name), P.write_message(P.SwitchReport(**report)))
    store.add(P.mig_key(migration_id, "switched_count"), 1)
    events.emit("joiner_started", migration_id=migration_id, step=start_step,
                first_step_s=round(first_step_s, 4), recv_s=round(report["recv_s"], 4),
                **{k: report[k] for k in ("precopy_steps", "switch_recv_s", "precopy_slack_s")
                   if k in report})
