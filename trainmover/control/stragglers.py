"""The controller's driver for slow workers: reads each worker's recent windows of step
measurements (``perf/<worker>``), asks the detector (``core/stragglers.py``) and applies
the policy (``StragglerConfig``): ``alert`` reports a straggler (an event, a line, the
summary), ``migrate`` also hands its role to a warm standby when the cost rule says so. The
slow process leaves the job with the migration (quarantined: never taken back as a standby).
One straggler migration at a time, then ``cooldown_steps`` for the job to settle."""
from __future__ import annotations

import time
from statistics import median

from trainmover.control.context import JobContext
from trainmover.control.migrations import MigrationRequest, Migrations
from trainmover.core import decisions as C
from trainmover.core import protocol as P
from trainmover.core.auth import read_raw
from trainmover.core.stragglers import DetectorSettings, StragglerDetector, Window, worth_moving


class Stragglers:
    STATE = ("found", "moved", "last_move_step", "not_moved")

    def __init__(self, ctx: JobContext, migrations: Migrations):
        self.ctx, self.migrations = ctx, migrations
        cfg = ctx.cfg.straggler
        self.detector = StragglerDetector(DetectorSettings(
            cfg.window, cfg.min_shift, cfg.min_windows, cfg.settle_windows,
            cfg.baseline_windows))
        self.found: list[dict] = []        # each straggler episode, as reported
        self.moved: list[str] = []         # workers moved away for being slow
        self.not_moved: dict[str, str] = {}   # worker -> why not (reported once)
        self.last_move_step = -1
        self._flagged: set[str] = set()    # in an episode now
        self.latest: dict[str, P.StepPerf] = {}   # each role holder's newest measurements
        self._read_at = 0.0
        self._decoded: dict[str, tuple[bytes, P.StepPerf | None]] = {}   # worker -> last read

    def _decode(self, worker: str, key: str, raw: bytes) -> P.StepPerf | None:
        """``raw`` at ``key`` as a genuine ``StepPerf`` (None: forged or malformed, logged);
        the last value decoded is kept, and not decoded again while it stands."""
        seen = self._decoded.get(worker)
        if seen is not None and seen[0] == raw:
            return seen[1]
        perf = None
        payload = self.ctx.store.genuine(key, raw)
        if payload is not None:
            try:
                perf = P.read_message(P.StepPerf, payload)
            except P.MessageError as exc:
                self.ctx.events.emit("message_rejected", key=key, error=str(exc))
        self._decoded[worker] = (raw, perf)
        return perf

    def poll(self) -> None:
        ctx, cfg = self.ctx, self.ctx.cfg.straggler
        if cfg.policy == "off" or time.time() - self._read_at < cfg.check_interval_s:
            return
        self._read_at = time.time()
        holders = ctx.membership.workers
        windows = []
        self.latest = {}
        names = sorted(holders)
        keys = [P.perf_key(w) for w in names]
        # every worker's in a few requests; decoded only where the value changed (a worker
        # rewrites it once a window): one round trip and one decode a worker each look was
        # most of the controller's time at a thousand workers
        for w, key, raw in zip(names, keys, read_raw(ctx.store, keys)):
            role = holders[w]
            perf = None if raw is None else self._decode(w, key, raw)
            if perf is not None and perf.role == role.name:
                self.latest[w] = perf
                recent = perf.recent or [P.PerfWindow(perf.first_step, perf.last_step,
                                                      perf.compute_s)]
                windows += [Window(w, role, r.first_step, r.last_step, perf.tenure_start,
                                   r.compute_s) for r in recent]
        for gone in set(self._decoded) - set(holders):
            del self._decoded[gone]
        self.detector.keep_only(set(holders))
        self._flagged &= set(holders)
        for v in self.detector.observe(windows):
            if v.straggler and v.worker not in self._flagged:
                self._flagged.add(v.worker)
                self._report(v)
            elif not v.straggler and v.slow_windows == 0 and v.worker in self._flagged:
                self._flagged.discard(v.worker)
                ctx.events.emit("straggler_cleared", worker=v.worker, role=v.role,
                                step=v.step, score=v.score)
            if v.straggler and cfg.policy == "migrate":
                self._maybe_move(v)

    def _report(self, v) -> None:
        ctx = self.ctx
        record = {"worker": v.worker, "role": v.role, "step": v.step, "score": v.score,
                  "reference": v.reference, "excess_s": round(v.excess_s, 6),
                  "policy": ctx.cfg.straggler.policy}
        self.found.append(record)
        ctx.events.emit("straggler_detected", level="warning", **record)
        ctx.progress.say(f"straggler: {v.worker} ({v.role}) computes {1 / v.score:.2f}x its "
                         f"{v.reference}' time since about step "
                         f"{v.step - ctx.cfg.straggler.window * v.slow_windows + 1}")

    def _migration_cost_s(self) -> float:
        done = [m["downtime_s"] for m in self.migrations.finished
                if m.get("status") == "done" and m.get("downtime_s") is not None]
        return median(done) if done else self.ctx.cfg.straggler.migration_cost_s

    def _maybe_move(self, v) -> None:
        ctx, cfg = self.ctx, self.ctx.cfg.straggler
        if v.worker in self.moved or self.migrations.active is not None or \
                self.migrations.pending:
            return
        if self.last_move_step >= 0 and ctx.committed - self.last_move_step < cfg.cooldown_steps:
            return
        warm = [s for s, st in ctx.membership.standbys.items() if st is C.StandbyState.WARM]
        total = ctx.cfg.train.steps
        steps_left = total - ctx.committed - 1 if total else 10 ** 9
        cost = self._migration_cost_s()
        why = None
        if not warm:
            why = "no warm standby"
        elif not worth_moving(v.excess_s, steps_left, cost):
            why = (f"not worth it: {v.excess_s * steps_left:.2f} s to lose over the last "
                   f"{steps_left} steps, a migration costs {cost:.2f} s")
        if why is not None:
            if self.not_moved.get(v.worker) != why:
                self.not_moved[v.worker] = why
                ctx.events.emit("straggler_not_moved", worker=v.worker, reason=why)
            return
        self.moved.append(v.worker)
        self.last_move_step = ctx.committed
        ctx.events.emit("straggler_migration", worker=v.worker, role=v.role, score=v.score,
                        expected_loss_s=round(v.excess_s * steps_left, 3),
                        migration_cost_s=round(cost, 4))
        ctx.progress.say(f"moving straggler {v.worker} ({v.role}) to a warm standby")
        self.migrations.submit(MigrationRequest([v.worker], source="straggler"))
