"""A worker's side of a recovery from an unexpected failure: the survivor's and the joiner's.

A survivor's step was doomed (a peer died or hung, or the job aborted the step): the
optimizer did not run, so it still holds the state after the last committed step. It reports
what it saw (the error, whether its own communicator failed, each group's operation
accounting, from which the controller tells clean groups from dirty ones), waits for the
plan, rebuilds the groups the plan names, rolls back to a snapshot or checkpoint if told to,
sends its state to a joiner if it is the replica of a failed role, and resumes at the plan's
step.

A joiner (a standby the plan promotes) builds the failed role's groups, then takes the
role's state from a live data-parallel replica, the peer snapshot or the checkpoint.

Every wait here is abortable: if the controller abandons the plan (a joiner or another
survivor failed meanwhile), it aborts the plan's epoch and every wait raises ``StepAborted``;
the survivor then reports again and waits for the next plan.
"""
from __future__ import annotations

import dataclasses
import threading
import time

from trainmover.comm.groups import AbortSignal, CommGroups, Group, StepAborted
from trainmover.core import protocol as P
from trainmover.core.snapshots import SnapshotUnavailable
from trainmover.core.topology import Role
from trainmover.train.checkpoint import CheckpointCorrupt, load_local
from trainmover.train.snapshot import fetch_snapshot
from trainmover.train.transfer import recv_state, recv_striped, send_state
from trainmover.worker.liveness import is_step_failure
from trainmover.worker.migration import transfer_spec

# How often ``abortably`` looks at the abort signal while a group build runs: it is on the
# recovery's critical path (downtime), where a millisecond counts more than idle wake-ups.
BUILD_ABORT_POLL_S = 0.001


def report_failure(ctx, step: int, error: str, groups: CommGroups) -> None:
    """Tell the controller what this worker saw: the error, whether its own communicator
    failed, and each group's operation accounting (which groups are still consistent). On
    its channel to its agent, which writes the host's reports as one value
    (``agent/reports.py``); in the store itself without one (a process no agent started:
    it does not beat either, and the controller reads such a key only for a worker whose
    host it does not know)."""
    own = [g.name for g in groups.slots().values()
           if g.error is not None and g.error.op == "abort"]
    accounting = {g.name: g.accounting() for g in groups.slots().values() if g.size > 1}
    report = P.FailureReport(step, error[:400], bool(own), accounting)
    if ctx.inbox is not None:
        try:
            message = P.report_message(ctx.epoch, report)
        except P.MessageError:
            # past the channel's size (five groups' counters and 400 characters are not):
            # sent without the error's text rather than not at all
            message = P.report_message(ctx.epoch, dataclasses.replace(report, error=""))
        ctx.inbox.send(message)
    else:
        ctx.store.set(P.failure_key(ctx.epoch, ctx.name), P.write_message(report))
        ctx.store.add(P.failure_count_key(ctx.epoch), 1)
    ctx.events.emit("step_failed", step=step, epoch=ctx.epoch, error=error[:300])


def note_recovered(ctx, recovery_id: int) -> None:
    """Tell the controller this worker's part of recovery ``recovery_id`` is done: on its
    channel, the agent adding the host's number to the recovery's count once
    (``agent/reports.py``); without a channel, its own signed note and an add to the count."""
    if ctx.inbox is not None:
        ctx.inbox.send(P.recovered_message(recovery_id))
    else:
        ctx.store.set(P.own_recovered_key(recovery_id, ctx.name),
                      P.write_message(P.HostRecovered(recovery_id, [ctx.name])))
        ctx.store.add(P.recovered_count_key(recovery_id), 1)


def abortably(signal: AbortSignal, build):
    """Run ``build`` (a group rendezvous: a blocking call gloo cannot cancel) in a helper
    thread and wait for it, or raise ``StepAborted`` as soon as the epoch is aborted. An
    abandoned build times out on its own; its generation is never used again."""
    box: dict = {}
    done = threading.Event()

    def target():
        try:
            box["value"] = build()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            box["error"] = exc
        done.set()

    threading.Thread(target=target, daemon=True, name="recovery-build").start()
    while not done.wait(BUILD_ABORT_POLL_S):
        if signal.is_set():
            raise StepAborted(f"group build abandoned: {signal.reason}")
    if "error" in box:
        raise box["error"]
    return box["value"]


def survive(ctx, role: Role, groups: CommGroups, state, migrations, step: int,
            error: str) -> tuple[int, P.Recover]:
    """Carry out this survivor's part of the recovery of ``step``; returns the step to resume
    at and the plan's command. The caller starts voting in the plan's epoch."""
    t0 = time.perf_counter()
    report_failure(ctx, step, error, groups)
    if state is not None and state.buckets is not None:
        state.buckets.quarantine()   # before the gradients are used again
    layout = ctx.cfg.layout
    while True:
        cmd = ctx.commands.next()
        if not isinstance(cmd, P.Recover):
            ctx.events.emit("command_dropped", command=type(cmd).__name__, reason="recovering")
            continue
        ctx.fault("recover", cmd.resume_step)
        migrations.active.clear()  # a migration in flight was settled by the controller
        # the recovery's own epoch: if the controller abandons this plan (a joiner or
        # another survivor failed meanwhile), every wait below is woken up
        ctx.abort.clear()
        ctx.watch_abort(cmd.epoch)
        try:
            built = abortably(ctx.abort, lambda: {
                name: ctx.builder.build(layout.group(name), role, gen)
                for name, gen in sorted(cmd.groups.items())})
            migrations.retired.extend(groups.install(built))
            if cmd.rollback_step is not None:
                state.load(rollback_state(ctx, role.name, cmd.rollback_step,
                                          cmd.rollback_from))
            sent = None
            if cmd.send_states:
                # every channel first, in the one global name order of group builds (no
                # build waits on a transfer), then the transfers one after the other: each
                # joiner receives its shares from every sender at once
                sends = sorted(cmd.send_states, key=lambda s: s.transfer_group)
                channels = abortably(ctx.abort, lambda: [ctx.builder.build_ranked(
                    transfer_spec(s.transfer_group, role), 0, s.transfer_generation)
                    for s in sends])
                sent = {"bytes": 0}
                for s, channel in zip(sends, channels):
                    sent["bytes"] += send_state(state, channel, 1, cmd.resume_step,
                                                part=(s.part, s.parts))["bytes"]
                    channel.shutdown()
        except Exception as err:  # noqa: BLE001 - sorted by is_step_failure
            # a corrupt checkpoint file is marked so, a snapshot that cannot be had is
            # reported: the controller plans again from an older source
            if not (is_step_failure(err, ctx.abort) or
                    isinstance(err, (CheckpointCorrupt, SnapshotUnavailable))):
                raise
            ctx.epoch = cmd.epoch
            report_failure(ctx, cmd.resume_step, f"{type(err).__name__}: {err}", groups)
            continue
        break
    ctx.epoch = cmd.epoch
    note_recovered(ctx, cmd.recovery_id)
    ctx.events.emit("recovered", recovery_id=cmd.recovery_id, epoch=ctx.epoch,
                    resume_step=cmd.resume_step, rebuilt=sorted(built),
                    rollback_step=cmd.rollback_step,
                    sent_bytes=None if sent is None else sent["bytes"],
                    duration_s=round(time.perf_counter() - t0, 4))
    return cmd.resume_step, cmd


def rollback_state(ctx, role_name: str, step: int, holder: str | None) -> dict:
    """A role's state before ``step``: from the peer snapshot at ``holder`` (memory, no
    disk), else from the disk checkpoint (verified against its manifest)."""
    if holder is None:
        return load_local(ctx.run_dir, step, role_name)
    cfg = ctx.cfg.snapshot
    t0 = time.perf_counter()
    state = fetch_snapshot(holder, ctx.stores.run_key, role_name, step, cfg.connect_timeout_s,
                           cfg.io_timeout_s)
    ctx.events.emit("snapshot_fetched", step=step, holder=holder,
                    duration_s=round(time.perf_counter() - t0, 4))
    return state


# --- the joiner ----------------------------------------------------------------------------------

def joiner_build(ctx, role: Role, command: P.AssignRecovery) -> tuple[CommGroups, list[Group]]:
    """Build the failed role's groups (at the generations the plan gives) and, when the state
    comes from live replicas, the channel from each (share 0's first)."""
    source = command.source
    specs = {s.name: s for s in ctx.cfg.layout.groups_of(role).values()}
    names = [source.transfer_group] + list(source.more_groups or []) \
        if source.kind == "replica" else []
    for name in names:
        specs[name] = transfer_spec(name, role)
    built = {}
    for name, spec in sorted(specs.items()):
        if spec.kind == "xfer":
            built[name] = ctx.builder.build_ranked(spec, 1, source.transfer_generation)
        else:
            built[name] = ctx.builder.build(spec, role, command.groups.get(name, 0))
    channels = [built.pop(name) for name in names]
    return CommGroups.from_groups(role, ctx.cfg.layout, built), channels


def joiner_restore(ctx, role: Role, command: P.AssignRecovery, state,
                   channels: list[Group]) -> int:
    """Take the role's state from the replicas (a share over each of ``channels``: striped)
    or the checkpoint; returns the step to resume at, checked against the plan's."""
    source = command.source
    if len(channels) > 1:
        start_step, got = recv_striped(state, channels, 0)
        for channel in channels:
            channel.shutdown()
        ctx.events.emit("state_received", sources=len(channels), bytes=got["bytes"],
                        shares=got["shares"], seconds=round(got["seconds"], 4))
    elif channels:
        start_step, got = recv_state(state, channels[0], 0)
        channels[0].shutdown()
        ctx.events.emit("state_received", sources=1, bytes=got["bytes"],
                        seconds=round(got["seconds"], 4))
    else:
        start_step = source.step
        state.load(rollback_state(ctx, role.name, start_step,
                                  source.address if source.kind == "snapshot" else None))
    if start_step != command.resume_step:
        raise RuntimeError(f"{ctx.name}: state for step {start_step}, expected "
                           f"{command.resume_step}")
    ctx.epoch = command.epoch
    return start_step
