"""The controller's driver for slow workers: reads each worker's recent windows of step
measurements (one ``P.HostPerf`` a host, which its agent writes: ``agent/perfs.py``), asks
the detector (``core/stragglers.py``) and applies the policy (``StragglerConfig``): ``alert``
reports a straggler (an event, a line, the summary), ``migrate`` also hands its role to a
warm standby when the cost rule says so. The slow process leaves the job with the migration
(quarantined: never taken back as a standby). One straggler migration at a time, then
``cooldown_steps`` for the job to settle.

Off the detection path: the reading, decoding and judging (``PerfFeed``) run on a thread of
their own with a store client of their own, fed with the hosts whose beats announced new
measurements (``Health.perf_moved``); the supervision round only hands it those hosts and
acts on the verdicts that came back. At 16K workers a window's decoding and judging took
hundreds of milliseconds, which in the round delayed every crash's detection as long.
"""
from __future__ import annotations

import queue
import threading
import time
from statistics import median
from typing import Callable

from trainmover.control import collector
from trainmover.control.context import JobContext
from trainmover.control.health import Health
from trainmover.control.migrations import MigrationRequest, Migrations
from trainmover.control.status import status_perf
from trainmover.core import decisions as C
from trainmover.core import protocol as P
from trainmover.core.auth import KEYS_PER_READ, read_raw
from trainmover.core.stragglers import (DetectorSettings, StragglerDetector, Verdict, Window,
                                        worth_moving)


PACE_HOSTS = 16      # hosts decoded between two yields of the feed's thread (about 1 ms)


class PerfFeed:
    """Reads the hosts' ``HostPerf`` values and judges the windows in them. Touches nothing
    of the controller's but the membership's worker table, whose object a membership change
    replaces instead of changing (``core/decisions.py``): taken once per pass, it cannot
    change under the pass."""

    def __init__(self, ctx: JobContext, store):
        self.ctx, self.store = ctx, store
        cfg = ctx.cfg.straggler
        self.detector = StragglerDetector(DetectorSettings(
            cfg.window, cfg.min_shift, cfg.min_windows, cfg.settle_windows,
            cfg.baseline_windows))
        self._raw: dict[int, bytes] = {}                # host -> its value as last read
        # each role holder's newest window as the status shows it (``status_perf``: one
        # dict, where the decoded message held its window history, ~8 objects a worker a
        # window that the garbage collector's full collections walked)
        self._latest: dict[str, dict] = {}

    def _decode(self, key: str, raw: bytes) -> P.HostPerf | None:
        payload = self.store.genuine(key, raw)
        if payload is None:
            return None
        try:
            return P.read_message(P.HostPerf, payload)
        except P.MessageError as exc:
            self.ctx.events.emit("message_rejected", key=key, error=str(exc))
            return None

    def collect(self, hosts: set[int], pace: bool = False
                ) -> tuple[list[Verdict], dict[str, dict]]:
        """Read ``hosts``' measurements, judge the windows new in them; the verdicts and
        each role holder's newest measurements. ``pace``: give the interpreter up every
        ``PACE_HOSTS`` hosts decoded (on the thread: the round, back from a store request,
        takes it then instead of waiting for the interpreter's switch interval)."""
        holders = self.ctx.membership.workers
        windows = []
        decoded = 0
        nodes = sorted(hosts)
        for i in range(0, len(nodes), KEYS_PER_READ):
            part = nodes[i:i + KEYS_PER_READ]
            keys = [P.agent_key(n, "perf") for n in part]
            for node, key, raw in zip(part, keys, read_raw(self.store, keys)):
                if raw is None or raw == self._raw.get(node):
                    continue
                self._raw[node] = raw
                decoded += 1
                if pace and decoded % PACE_HOSTS == 0:
                    time.sleep(0)
                host = self._decode(key, raw)
                if host is None:
                    continue
                for w, perf in host.workers.items():
                    role = holders.get(w)
                    if role is None or perf.role != role.name:
                        continue
                    self._latest[w] = status_perf(perf)
                    recent = perf.recent or [P.PerfWindow(perf.first_step, perf.last_step,
                                                          perf.compute_s)]
                    # the windows not taken in yet only: the history repeats up to
                    # PERF_HISTORY of them, and making every one each time was most of the
                    # objects a pass left for the garbage collector
                    seen = self.detector.seen(w, perf.tenure_start)
                    windows += [Window(w, role, r.first_step, r.last_step, perf.tenure_start,
                                       r.compute_s) for r in recent if r.last_step > seen]
        for gone in [w for w in self._latest if w not in holders]:
            del self._latest[gone]
        self.detector.keep_only(set(holders))
        return self.detector.observe(windows), dict(self._latest)


class Stragglers:
    STATE = ("found", "moved", "last_move_step", "not_moved")

    def __init__(self, ctx: JobContext, migrations: Migrations, health: Health,
                 connect: Callable[[], object]):
        """``connect``: a new store client, for the feed's thread."""
        self.ctx, self.migrations, self.health = ctx, migrations, health
        self.connect = connect
        self.found: list[dict] = []        # each straggler episode, as reported
        self.moved: list[str] = []         # workers moved away for being slow
        self.not_moved: dict[str, str] = {}   # worker -> why not (reported once)
        self.last_move_step = -1
        self._flagged: set[str] = set()    # in an episode now
        self.latest: dict[str, dict] = {}   # each role holder's newest window (status_perf)
        self._read_at = 0.0
        self._moved: set[int] = set()      # hosts with news, not handed to the feed yet
        self._thread: threading.Thread | None = None
        self._todo: queue.Queue = queue.Queue()      # host sets, to the thread
        self._done: queue.Queue = queue.Queue()      # (verdicts, latest), from it

    def _run(self) -> None:
        """The feed's thread: each batch of hosts handed to it (the ones queued meanwhile
        with it), read and judged."""
        try:
            feed = PerfFeed(self.ctx, self.connect())
        except Exception as exc:  # noqa: BLE001 - the store is gone: so is the controller
            self.ctx.events.emit("straggler_feed_stopped", level="warning", error=str(exc))
            return
        while True:
            hosts = self._todo.get()
            while not self._todo.empty():
                hosts |= self._todo.get()
            try:
                with collector.paused():
                    self._done.put(feed.collect(hosts, pace=True))
            except Exception as exc:  # noqa: BLE001 - a store error: the next window's try
                self.ctx.events.emit("straggler_feed_error", level="warning", error=str(exc))

    def poll(self) -> None:
        cfg = self.ctx.cfg.straggler
        if cfg.policy == "off":
            return
        now = time.time()
        self.health.read_hosts(now)      # done by the health look, unless it is off
        self._moved |= self.health.perf_moved()
        if self._moved and now - self._read_at >= cfg.check_interval_s:
            self._read_at = now
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="straggler-feed",
                                                daemon=True)
                self._thread.start()
            self._todo.put(self._moved)
            self._moved = set()
        while not self._done.empty():
            verdicts, self.latest = self._done.get()
            self._act(verdicts)

    def _act(self, verdicts: list[Verdict]) -> None:
        ctx, cfg = self.ctx, self.ctx.cfg.straggler
        holders = ctx.membership.workers
        self._flagged = {w for w in self._flagged if w in holders}
        for v in verdicts:
            if v.worker not in holders:
                continue        # left its role while the feed judged it
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
