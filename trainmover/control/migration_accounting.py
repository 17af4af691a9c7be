"""A completed migration's accounting (``Migrations.finish_downtimes``): its downtime, from
its stayers' step-end times (``core/accounting.py``), and the phases its participants
reported, as the ``migration_done`` event and the caller's result give them."""
from __future__ import annotations

import statistics
import time

from trainmover.control.context import JobContext, read_messages
from trainmover.core import protocol as P
from trainmover.core.accounting import (downtime_from_metrics, phase_one_extra,
                                         slowest_stayer, stayer_downtime)


def normal_train_step(ctx: JobContext, before: int) -> float | None:
    """The median of the reporter's own step times of the steps before ``before``."""
    times = [r["step_time_s"] for r in ctx.progress.records
             if before - P.DOWNTIME_BASELINE_STEPS <= r["step"] < before
             and "step_time_s" in r]
    return statistics.median(times) if times else None


def stayer_accounts(ctx: JobContext, mig
                    ) -> tuple[dict[str, tuple[float, float, float]], int, float | None]:
    """Each stayer's (downtime, normal gap, noise) from the step ends it posted; the first
    step at whose boundary a stayer began phase 1 (the switch step if none posted); and the
    most phase 1 cost a stayer's steps (``phase_one_extra``)."""
    out, began, extra = {}, mig.switch_step, []
    stayers = mig.plan.stayers
    posted = read_messages(
        ctx, P.StepEnds, [P.mig_key(mig.plan.migration_id, "steps", w) for w in stayers])
    for w, ends in zip(stayers, posted):
        if ends is None or ends.switch_step != mig.switch_step:
            continue
        began = min(began, ends.prepare_step)
        account = stayer_downtime(ends.first_step, ends.prepare_step, ends.switch_step,
                                  ends.ends, P.DOWNTIME_STEPS_AFTER, P.DOWNTIME_BASELINE_STEPS)
        if account is not None:
            out[w] = account
            x = phase_one_extra(ends.first_step, ends.prepare_step, ends.switch_step,
                                ends.ends, account[1])
            if x is not None:
                extra.append(x)
    return out, began, max(extra) if extra else None


def migration_result(ctx: JobContext, mig) -> dict:
    """The ``migration_done`` record of ``mig`` (an ``ActiveMigration`` whose switch the
    job passed): every participant's report read in a few requests."""
    plan, mid = mig.plan, mig.plan.migration_id
    # a report that cannot be read (logged) counts as zeros: accounting, not control
    who = plan.participants
    reports = {w: r or P.SwitchReport() for w, r in zip(who, read_messages(
        ctx, P.SwitchReport, [P.mig_key(mid, "switched", w) for w in who]))}
    ready = {w: r for w, r in zip(who, read_messages(
        ctx, P.ReadyReport, [P.mig_key(mid, "ready", w) for w in who])) if r is not None}
    # the job's downtime is its slowest stayer's (module doc of core/accounting.py); the
    # reporter's commit gap is kept beside it, and stands in where no stayer posted
    downtime = normal = noise = reporter = None
    if ctx.progress.last_step >= mig.switch_step:
        reporter, normal = downtime_from_metrics(ctx.progress.records, mig.switch_step)
    accounts, began, phase_one = stayer_accounts(ctx, mig)
    slowest = slowest_stayer(accounts)
    if slowest is not None:
        _, downtime, normal, noise = slowest
    else:
        downtime = reporter
    leaver_r = [reports[p.leaver] for p in plan.pairs]
    joiner_r = [reports[p.joiner] for p in plan.pairs]
    stayer_r = [reports[w] for w in plan.stayers]
    rss_growth = [r.rss_after["peak_rss_mb"] / r.rss_before["peak_rss_mb"] - 1.0
                  for r in stayer_r if r.rss_before and r.rss_after]
    phases = {
        # training continued through these (not downtime)
        "prepare_s": max([r.prepare_s if r.prepare_s is not None else r.build_s
                          for r in ready.values()] or [0.0]),
        # what that background work cost the stayers' steps beyond normal ones
        "phase1_slowdown_s": phase_one,
        "wait_boundary_s": max([r.wait_boundary_s for r in leaver_r] or [0.0]),
        # the switch itself
        "transfer_s": max(r.transfer_s for r in leaver_r),
        "group_switch_s": max([r.build_s + r.install_s if plan.rebuild_all else r.install_s
                               for r in stayer_r] or [0.0]),
        "joiner_recv_s": max(r.recv_s for r in joiner_r),
        "first_step_s": max(r.first_step_s for r in joiner_r),
        "normal_step_s": normal,
        # the same quantity as first_step_s (a step's own time, from its start in the
        # loop to its end), on the reporter before phase 1: their ratio is like for like
        "normal_train_step_s": normal_train_step(ctx, began),
    }
    return {"status": "done", **plan.describe(), "source": mig.request.source,
            "switch_step": mig.switch_step,
            "downtime_s": downtime, "phases": phases,
            "downtime_noise_s": noise, "downtime_reporter_s": reporter,
            "downtime_by": {"stayers": len(plan.stayers), "reported": len(accounts),
                            "slowest": slowest[0] if slowest else None},
            "transfer_bytes": sum(r.transfer_bytes for r in leaver_r),
            "stayer_peak_rss_growth": max(rss_growth) if rss_growth else None,
            "naive": mig.request.naive,
            "warmup_wait_s": round(mig.warmup_wait_s, 3),
            "requested_to_done_s": time.time() - mig.t_start}
