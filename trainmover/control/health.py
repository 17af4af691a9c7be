"""The controller's failure detector: which active workers crashed, hung or lost their own
communicator. Detection only; the recovery driver acts on what it finds.

Bounded detection:
- a crashed worker: its process exit is seen at the next poll (tens of milliseconds);
- a hung worker (stopped, wedged): its heartbeat stops moving. The step watchdog
  localizes it early: once no step was committed for ``stall_factor`` x the recent step time
  (at least ``stall_floor_s``), the workers silent for ``silence_beats`` heartbeat intervals
  (at least ``silence_floor_s``) while the others beat are the hung ones; judged only in
  steady state (``JobContext.disrupted``), and only while the silent ones are on at most
  ``silence_max_hosts`` hosts (a wider silence is load or a network hiccup more likely than
  that many hangs at once). Otherwise, after ``heartbeat_timeout_s``, a silent worker is hung
  regardless (settings: ``HealthConfig``);
- a failed collective: a worker whose own communicator was aborted says so in its failure
  report;
- a lost host (its machine died, or its link is down): its agent's heartbeat stops, judged by
  the same two rules as a worker's. The host is declared lost at once: fenced (its agent, if
  it ever hears the store again, stops its processes and exits instead of rejoining with
  stale state), its standbys dead, its workers failed (kind "host").

Heartbeats come by host: each process beats on its own channel to its host's agent, which
writes one signed ``P.HostBeat`` for the host every heartbeat interval, with its own
sequence number and each process's count of beats. A host's beat moved only when a genuine
value's sequence went past the last one seen, and a process's when its count in such a
value did. Junk at a host's key (an unsigned value, a bumped counter, an older genuine beat
put back) is no beat: a stopped worker stays silent whatever others write there. Each look
reads every host's key in one request per ``HOSTS_PER_READ`` hosts and decodes only the
values that changed: the controller's work and the store's load go with the hosts, not the
processes (a read per process was most of a round at a thousand workers).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from trainmover.control.context import JobContext
from trainmover.core import decisions as C
from trainmover.core import protocol as P
from trainmover.core.accounting import stalled_for


@dataclass
class Failure:
    worker: str
    kind: str            # crash | hang | commerr | host
    detected_at: float
    detail: str = ""


HOSTS_PER_READ = 1024     # host beats read in one store request
SILENT_AGENT = "its agent fell silent while other hosts are heard"


class Health:
    def __init__(self, ctx: JobContext):
        self.ctx = ctx
        self._beats: dict[str, tuple[tuple[int, int], float]] = {}  # (pid, beats), seen at
        # (agent pid, seq) of the newest beat (None: none yet), seen at (first looked at)
        self._host_beats: dict[int, tuple[tuple[int, int] | None, float]] = {}
        self._host_raw: dict[int, bytes] = {}     # each host's beat as last read (undecoded)
        self._hosts_read_at = float("-inf")
        self._looked_at = 0.0
        self._reports_seen: tuple[int, int] = (-1, 0)                 # epoch, count
        self._standbys_looked_at = 0.0
        self._unbeaten: dict[tuple[str, int], float] = {}             # first seen without a beat
        self._reported: set[tuple[str, int]] = set()    # standby incarnations found hung
        self._wide: set[str] = set()     # wide silences reported ("workers", "agents")

    def detect(self, handled: set[str]) -> list[Failure]:
        """New failures among the active workers, other than the ``handled`` ones."""
        ctx, health, now = self.ctx, self.ctx.cfg.health, time.time()
        out = []
        # process exits every round; store look-ups (heartbeats, reports) less often
        look = now - self._looked_at >= health.check_interval_s
        if look:
            self._looked_at = now
        stalled = self.stalled_for(now) if look else None
        timeout = self._heartbeat_timeout_s()
        # every report of the epoch in a few requests, when new ones came
        reports = read_failure_reports(ctx, ctx.epoch, [w for w in ctx.membership.workers
                                                        if w not in handled]) \
            if look and self._new_reports() else {}
        silent, beating = [], set()      # beating: hosts with a worker heard recently
        # once a round, not per worker (a loop over every worker: what it does per worker
        # is what the controller's round costs at scale)
        silence_s = health.silence_s()
        if look:
            self.read_hosts(now)
        for w in list(ctx.membership.workers):
            if w in handled or not ctx.procs.known(w):
                continue
            node = ctx.procs.procs[w].node
            if node in ctx.procs.lost:
                out.append(Failure(w, "host", now, f"host {node} lost"))
                continue
            code = ctx.procs.exit_code(w)
            if code is not None and code != 0:
                out.append(Failure(w, "crash", now, f"exit code {code}"))
                continue
            if code == 0 or not look:
                continue
            beat = self._beat(w, read=False)
            quiet = None if beat is None else now - beat
            if quiet is not None and quiet > silence_s and \
                    ctx.store.valid(P.finished_key(w)) is not None:
                continue   # done with the job: its heartbeat may stop
            if quiet is not None and quiet > timeout:
                out.append(Failure(w, "hang", now, f"no heartbeat for {quiet:.2f} s"))
                continue
            if quiet is not None and quiet > silence_s:
                silent.append((w, quiet))
            elif quiet is not None:
                beating.add(node)
            report = reports.get(w)
            if report is not None and report.self_failed:
                out.append(Failure(w, "commerr", now, report.error))
        if not silent:
            self._wide.discard("workers")
        if stalled is not None and silent and beating and \
                self._narrow({ctx.procs.procs[w].node for w, _ in silent}, "workers"):
            for w, quiet in silent:
                out.append(Failure(w, "hang", now, f"silent for {quiet:.2f} s while the job "
                                                   f"made no progress for {stalled:.2f} s"))
        if look:
            hung = {ctx.procs.procs[f.worker].node for f in out if f.kind == "hang"}
            lost = self._check_hosts(now, beating, hung)
            if lost:
                # what failed on a lost host failed with it: one "host" failure per worker
                out = [f for f in out if ctx.procs.procs[f.worker].node not in lost]
                out += [Failure(w, "host", now, f"host {ctx.procs.procs[w].node} lost")
                        for w in ctx.membership.workers
                        if w not in handled and ctx.procs.procs[w].node in lost]
        return out

    def hung_standbys(self) -> list[tuple[str, str]]:
        """Standbys, free or reserved as a joiner, alive by their process but silent:
        ``(name, why)``. By the same bound as a worker: the heartbeat timeout once it beat,
        the start-up timeout from when its PID was known until its first beat. Each
        incarnation is reported once: its agent carries out the kill, and the exit is seen
        only a moment later, when the standby may look hung still."""
        ctx, health, now = self.ctx, self.ctx.cfg.health, time.time()
        if now - self._standbys_looked_at < health.check_interval_s:
            return []
        self._standbys_looked_at = now
        self.read_hosts(now)
        out = []
        for name, st in list(ctx.membership.standbys.items()):
            if st is C.StandbyState.DEAD or not ctx.procs.known(name) or \
                    not ctx.procs.running(name) or ctx.procs.procs[name].node in ctx.procs.lost:
                continue
            beat = self._beat(name, read=False)
            if beat is None:
                pid = ctx.procs.pid(name)
                if pid is None:
                    continue
                since = self._unbeaten.setdefault((name, pid), now)
                if now - since > health.startup_timeout_s:
                    out.append((name, f"no heartbeat {now - since:.1f} s after it started"))
            elif now - beat > health.heartbeat_timeout_s:
                out.append((name, f"no heartbeat for {now - beat:.2f} s"))
        out = [(name, why) for name, why in out
               if (name, ctx.procs.procs[name].incarnation) not in self._reported]
        self._reported.update((name, ctx.procs.procs[name].incarnation) for name, _ in out)
        return out

    def _check_hosts(self, now: float, beating: set[int], hung: set[int]) -> set[int]:
        """Declare lost the hosts whose agent fell silent: for the heartbeat timeout (the
        start-up timeout before its first beat), or for the silence interval while workers
        of other hosts are heard (a pause of everyone is no lost host), or for two beats
        when workers of the host were just found hung (the agent's last beat may have come
        a moment after its workers': the host, not the workers, failed). Returns them."""
        ctx, health = self.ctx, self.ctx.cfg.health
        self.read_hosts(now)
        quiet_of = {}
        # host 0 serves the built-in store (its loss ends the job anyway); with the store on
        # etcd it is a host like any other
        for node in range(0 if ctx.cfg.process.etcd else 1, ctx.procs.nnodes):
            if node in ctx.procs.lost:
                continue
            seen = self._host_beats.setdefault(node, (None, now))
            quiet_of[node] = (now - seen[1], seen[0] is not None)
        found = {}
        for node, (quiet, started) in quiet_of.items():
            others = (beating - {node}) or {n for n, (q, _) in quiet_of.items()
                                            if n != node and q < health.silence_s()}
            if not started:
                why = quiet > health.startup_timeout_s and "never connected"
            elif quiet > health.heartbeat_timeout_s:
                why = "its agent's heartbeat stopped"
            elif node in hung and quiet > 2 * health.heartbeat_interval_s:
                why = "its workers hung and its agent fell silent"
            else:
                why = quiet > health.silence_s() and bool(others) and \
                    SILENT_AGENT
            if why:
                found[node] = f"{why} ({quiet:.2f} s)"
        silent = {node for node, why in found.items() if why.startswith(SILENT_AGENT)}
        if not silent:
            self._wide.discard("agents")
        elif not self._narrow(silent, "agents"):
            found = {node: why for node, why in found.items() if node not in silent}
        for node, why in found.items():
            self._declare_lost(node, why)
        return set(found)

    def _narrow(self, nodes: set[int], whose: str) -> bool:
        """Whether a silence spans few enough hosts for the silence rules to act on it
        (``health.silence_max_hosts``); a wider one is reported once while it lasts, and
        waited out to the heartbeat timeout."""
        if len(nodes) <= self.ctx.cfg.health.silence_max_hosts:
            self._wide.discard(whose)
            return True
        if whose not in self._wide:
            self._wide.add(whose)
            self.ctx.events.emit("wide_silence", whose=whose, hosts=len(nodes),
                                 first=sorted(nodes)[:8], level="warning",
                                 waited_to_s=self.ctx.cfg.health.heartbeat_timeout_s)
        return False

    def _declare_lost(self, node: int, why: str) -> None:
        """Done at once, not through the outbox: repeating it is harmless."""
        ctx = self.ctx
        ctx.store.set(P.agent_key(node, "fenced"), why)
        names = ctx.procs.mark_lost(node)
        for name in names:
            if ctx.membership.standbys.get(name) not in (None, C.StandbyState.DEAD):
                ctx.membership.standbys[name] = C.StandbyState.DEAD
        ctx.events.emit("host_lost", node=node, reason=why, processes=names)
        ctx.progress.say(f"host {node} lost ({why}): fenced; its processes "
                         f"{', '.join(names) or '(none)'} count as failed")

    def _new_reports(self) -> bool:
        """Whether failure reports arrived in the current epoch since the last look (one
        counter read instead of one per worker)."""
        ctx = self.ctx
        count = ctx.store.add(P.failure_count_key(ctx.epoch), 0)
        new = (ctx.epoch, count) != self._reports_seen and count > 0
        self._reports_seen = (ctx.epoch, count)
        return new

    def _heartbeat_timeout_s(self) -> float:
        """The liveness timeout once the job committed a step since it last changed; the
        longer start-up timeout before that."""
        health, records = self.ctx.cfg.health, self.ctx.progress.records
        if records and records[-1]["time"] > self.ctx.steady_since:
            return health.heartbeat_timeout_s
        return health.startup_timeout_s

    def stalled_for(self, now: float) -> float | None:
        health = self.ctx.cfg.health
        times = [r["time"] for r in self.ctx.progress.records[-11:]]
        return stalled_for([t for t in times if t > self.ctx.steady_since], now,
                           health.stall_factor, health.stall_floor_s)

    def read_hosts(self, now: float) -> None:
        """Read every live host's beat (at most once per ``check_interval_s``): a host's
        own beat, and its processes', move when a genuine newer value says so."""
        ctx = self.ctx
        if now - self._hosts_read_at < ctx.cfg.health.check_interval_s:
            return
        self._hosts_read_at = now
        nodes = [n for n in range(ctx.procs.nnodes) if n not in ctx.procs.lost]
        for i in range(0, len(nodes), HOSTS_PER_READ):
            part = nodes[i:i + HOSTS_PER_READ]
            keys = [P.agent_key(n, "hb") for n in part]
            for node, key, raw in zip(part, keys, read_raw(ctx.store, keys)):
                if raw is None or raw == self._host_raw.get(node):
                    continue                      # nothing new: nothing to decode
                self._host_raw[node] = raw
                payload = ctx.store.genuine(key, raw)
                try:
                    beat = None if payload is None else P.read_message(P.HostBeat, payload)
                except P.MessageError as exc:
                    ctx.events.emit("message_rejected", key=key, error=str(exc))
                    beat = None
                seen = self._host_beats.get(node)
                if beat is None or seen is not None and not moved(seen[0], beat.pid,
                                                                  beat.seq):
                    continue                      # junk, or an older genuine beat put back
                self._host_beats[node] = ((beat.pid, beat.seq), now)
                for name, entry in beat.procs.items():
                    if not (isinstance(entry, list) and len(entry) == 2 and
                            all(isinstance(x, int) for x in entry)):
                        continue
                    mine = self._beats.get(name)
                    if moved(None if mine is None else mine[0], *entry):
                        self._beats[name] = (tuple(entry), now)

    def _beat(self, worker: str, read: bool = True) -> float | None:
        """Time the worker's heartbeat last moved (None before its first beat). ``read``:
        read the hosts' beats first (``read_hosts``), which a loop over workers does once."""
        pid = self.ctx.procs.pid(worker)
        if pid is None:
            return None   # not started yet
        if read:
            self.read_hosts(time.time())
        seen = self._beats.get(worker)
        if seen is None or seen[0][0] != pid:
            return None   # none yet, or only a former incarnation's: its own beats only
        return seen[1]


def moved(seen: tuple[int, int] | None, pid: int, seq: int) -> bool:
    """Whether ``(pid, seq)`` is a beat after ``seen`` (the newest seen): of another
    process, or further in the same process's sequence."""
    return seen is None or seen[0] != pid or seq > seen[1]


def read_raw(store, keys: list[str]) -> list[bytes | None]:
    """The keys' values as stored (undecoded): ``HOSTS_PER_READ`` keys a request where the
    store can."""
    many = getattr(store.raw, "try_multi_get", None)
    if many is None:
        return [store.raw.get(k) if store.raw.check([k]) else None for k in keys]
    out = []
    for i in range(0, len(keys), HOSTS_PER_READ):
        out += many(keys[i:i + HOSTS_PER_READ])
    return out


def read_failure_report(ctx: JobContext, epoch: int, worker: str) -> P.FailureReport | None:
    """The worker's own account of a failed step in ``epoch``, if it wrote one. A malformed
    one is logged and read as "no report" (its writer is then fenced as silent)."""
    return ctx.read(P.FailureReport, P.failure_key(epoch, worker))


def read_failure_reports(ctx: JobContext, epoch: int, workers: list[str]
                         ) -> dict[str, P.FailureReport]:
    """``read_failure_report`` of many workers, ``HOSTS_PER_READ`` keys a request (a
    recovery's survivors are every worker but the failed: one round trip each was most of
    the time from a crash to its plan at a thousand workers)."""
    many = getattr(ctx.store, "valid_many", None)
    out = {}
    for i in range(0, len(workers), HOSTS_PER_READ):
        part = workers[i:i + HOSTS_PER_READ]
        keys = [P.failure_key(epoch, w) for w in part]
        values = many(keys) if many is not None else [ctx.store.valid(k) for k in keys]
        for w, key, raw in zip(part, keys, values):
            if raw is None:
                continue
            try:
                out[w] = P.read_message(P.FailureReport, raw)
            except P.MessageError as exc:
                ctx.events.emit("message_rejected", key=key, error=str(exc))
    return out
