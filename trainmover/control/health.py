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
sequence number, how many processes run there, and the ones it did not hear from lately
(``quiet``, with how long). A host's beat moved only when a genuine value's sequence went
past the last one seen; a process not listed in it beat when it was written. Junk at a
host's key (an unsigned value, a bumped counter, an older genuine beat put back) is no beat:
a stopped worker stays silent whatever others write there. Each look reads every host's key
in one request per ``KEYS_PER_READ`` hosts and decodes only the values that changed, then
judges the processes listed: the controller's work and the store's load go with the hosts
and what is silent, not with the processes (a read per process was most of a round at a
thousand workers; a loop over every worker each look, and decoding every process's count,
most of it at a few thousand).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from trainmover.control.context import JobContext
from trainmover.control.host_notes import read_failure_reports
from trainmover.core import decisions as C
from trainmover.core import protocol as P
from trainmover.core.accounting import stalled_for
from trainmover.core.auth import read_raw, read_valid


@dataclass
class Failure:
    worker: str
    kind: str            # crash | hang | commerr | host
    detected_at: float
    detail: str = ""


@dataclass
class HostView:
    """What a host's newest genuine beat said (``P.HostBeat``): how many processes run
    there, and the quiet ones: ``name -> (pid, silent since)``, since None before a first
    beat. A process not listed beat when that beat was written."""
    running: int
    quiet: dict[str, tuple[int, float | None]]
    perf: tuple[int, int] = (0, 0)     # (agent pid, HostPerf seq) announced (agent/perfs.py)


SILENT_AGENT = "its agent fell silent while other hosts are heard"


class Health:
    def __init__(self, ctx: JobContext):
        self.ctx = ctx
        self._hosts: dict[int, HostView] = {}     # what each host's newest beat said
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
        self._perf_moved: set[int] = set()   # hosts that announced new step measurements

    def detect(self, handled: set[str]) -> list[Failure]:
        """New failures among the active workers, other than the ``handled`` ones.

        Proportional to what failed, not to the job: exits come from the process table's
        index of failed processes (every round), silences from the workers the hosts' beats
        list as quiet (every look), each host's beat looked at once. No loop over every
        worker: at 100K workers one took longer than the look's interval."""
        ctx, health, now = self.ctx, self.ctx.cfg.health, time.time()
        workers = ctx.membership.workers
        out = []
        for w in sorted(ctx.procs.failed(), key=C.natural):
            if w in handled or w not in workers:
                continue
            node = ctx.procs.procs[w].node
            if node in ctx.procs.lost:
                out.append(Failure(w, "host", now, f"host {node} lost"))
            else:
                out.append(Failure(w, "crash", now, f"exit code {ctx.procs.exit_code(w)}"))
        # process exits every round; store look-ups (heartbeats, reports) less often
        if now - self._looked_at < health.check_interval_s:
            return out
        self._looked_at = now
        stalled = self.stalled_for(now)
        timeout = self._heartbeat_timeout_s()
        silence_s = health.silence_s(ctx.procs.nnodes)
        self.read_hosts(now)
        found = {f.worker for f in out}
        # the workers to judge: the ones their hosts list as quiet, and every worker of a
        # silent host that no host rule covers (host 0 serving the built-in store)
        judged = [w for node, host in self._hosts.items() if node not in ctx.procs.lost
                  for w in host.quiet]
        for node in self._unjudged_silent_hosts(now, silence_s):
            judged += [w for w in workers if ctx.procs.procs.get(w) is not None and
                       ctx.procs.procs[w].node == node and w not in self._hosts[node].quiet]
        judged = [w for w in dict.fromkeys(judged) if w in workers and w not in handled and
                  w not in found and ctx.procs.known(w) and ctx.procs.exit_code(w) is None]
        ctx.procs.learn_pids(judged)
        quiet_of = {}
        for w in judged:
            beat = self._beat(w, read=False)
            if beat is not None and now - beat > silence_s:
                quiet_of[w] = now - beat
        finished = self._finished(list(quiet_of))  # done with the job: its beat may stop
        silent = []
        for w, quiet in quiet_of.items():
            if w in finished:
                continue
            if quiet > timeout:
                out.append(Failure(w, "hang", now, f"no heartbeat for {quiet:.2f} s"))
            else:
                silent.append((w, quiet))
        # every report of the epoch in a few requests, when new ones came
        if self._new_reports():
            reports = read_failure_reports(ctx, ctx.epoch, [w for w in workers
                                                            if w not in handled])
            found = {f.worker for f in out}
            for w, report in reports.items():
                if report.self_failed and w not in found and w not in finished and \
                        ctx.procs.known(w) and ctx.procs.exit_code(w) is None:
                    out.append(Failure(w, "commerr", now, report.error))
        beating = self._heard_hosts(now, silence_s)   # hosts with a process heard lately
        if not silent:
            self._wide.discard("workers")
        if stalled is not None and silent and beating and \
                self._narrow({ctx.procs.procs[w].node for w, _ in silent}, "workers"):
            found = {f.worker for f in out}
            for w, quiet in silent:
                if w not in found:
                    out.append(Failure(w, "hang", now, f"silent for {quiet:.2f} s while the "
                                                       f"job made no progress for "
                                                       f"{stalled:.2f} s"))
        hung = {ctx.procs.procs[f.worker].node for f in out if f.kind == "hang"}
        lost = self._check_hosts(now, beating, hung)
        if lost:
            # what failed on a lost host failed with it: one "host" failure per worker
            out = [f for f in out if ctx.procs.procs[f.worker].node not in lost]
            out += [Failure(w, "host", now, f"host {ctx.procs.procs[w].node} lost")
                    for w in workers
                    if w not in handled and ctx.procs.procs[w].node in lost]
        return out

    def _heard_hosts(self, now: float, silence_s: float) -> set[int]:
        """The hosts whose agent was heard within ``silence_s`` with a process that beat
        within it: the evidence that the job's processes are heard at all."""
        heard, lost, beats = set(), self.ctx.procs.lost, self._host_beats
        for node, host in self._hosts.items():
            if now - beats[node][1] > silence_s or node in lost:
                continue
            late = sum(1 for _, since in host.quiet.values()
                       if since is None or now - since > silence_s) if host.quiet else 0
            if host.running > late:
                heard.add(node)
        return heard

    def _unjudged_silent_hosts(self, now: float, silence_s: float) -> list[int]:
        """Hosts silent for ``silence_s`` that the host rules do not judge (host 0, when it
        serves the built-in store): their workers are judged one by one instead."""
        if self.ctx.cfg.process.etcd:
            return []
        seen = self._host_beats.get(0)
        if 0 in self.ctx.procs.lost or seen is None or seen[0] is None or \
                now - seen[1] <= silence_s or 0 not in self._hosts:
            return []
        return [0]

    def _finished(self, workers: list[str]) -> set[str]:
        """Which of ``workers`` finished their steps (a few requests)."""
        values = read_valid(self.ctx.store, [P.finished_key(w) for w in workers])
        return {w for w, v in zip(workers, values) if v is not None}

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
        ctx.procs.learn_pids(ctx.membership.standbys)
        out = []
        for name, st in list(ctx.membership.standbys.items()):
            if st is C.StandbyState.DEAD or not ctx.procs.known(name) or \
                    not ctx.procs.running(name) or ctx.procs.procs[name].node in ctx.procs.lost:
                continue
            beat = self._beat(name, read=False)
            if beat is None:
                pid = ctx.procs.procs[name].pid            # learnt above
                if pid is None:
                    continue
                since = self._unbeaten.setdefault((name, pid), now)
                if now - since > health.startup_s(ctx.procs.nnodes):
                    out.append((name, f"no heartbeat {now - since:.1f} s after it started"))
            elif now - beat > health.timeout_s(ctx.procs.nnodes):
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
        hosts = ctx.procs.nnodes
        # the hosts' beats come this often (less often than a worker's in a large job: the
        # store's budget for them, ``health.host_beats_per_s``), and every rule counts them
        beat_s, silence_s = health.host_beat_interval_s(hosts), health.silence_s(hosts)
        timeout = health.timeout_s(hosts)
        self.read_hosts(now)
        quiet_of = {}
        # host 0 serves the built-in store (its loss ends the job anyway); with the store on
        # etcd it is a host like any other
        for node in range(0 if ctx.cfg.process.etcd else 1, ctx.procs.nnodes):
            if node in ctx.procs.lost:
                continue
            seen = self._host_beats.setdefault(node, (None, now))
            quiet_of[node] = (now - seen[1], seen[0] is not None)
        # whether another host was heard: counted once, not per host (a set of all the
        # others built for each host was O(hosts^2) a look)
        fresh = sum(1 for q, _ in quiet_of.values() if q < silence_s)
        found = {}
        for node, (quiet, started) in quiet_of.items():
            if started and quiet <= min(2 * beat_s, silence_s, timeout):
                continue                            # heard lately: most hosts, at a look
            if not started:
                why = quiet > health.startup_s(hosts) and "never connected"
            elif quiet > timeout:
                why = "its agent's heartbeat stopped"
            elif node in hung and quiet > 2 * beat_s:
                why = "its workers hung and its agent fell silent"
            else:
                others = len(beating) > 1 or bool(beating) and node not in beating or \
                    fresh - (quiet < silence_s) > 0
                why = quiet > silence_s and others and SILENT_AGENT
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
                                 waited_to_s=self.ctx.cfg.health.timeout_s(
                                     self.ctx.procs.nnodes))
        return False

    def _declare_lost(self, node: int, why: str) -> None:
        """Done at once, not through the outbox: repeating it is harmless."""
        ctx = self.ctx
        ctx.store.set(P.agent_key(node, "fenced"), why)
        # the host's command messages its agent did not read (it deletes each as it reads
        # them, in order: the unread are the newest, down to the first one gone)
        number = ctx.cmd_next.get(str(node), 1) - 1
        while number >= 1 and ctx.store.delete_key(P.host_command_key(node, number)):
            number -= 1
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
        hosts = self.ctx.procs.nnodes
        if records and records[-1]["time"] > self.ctx.steady_since:
            return health.timeout_s(hosts)
        return health.startup_s(hosts)

    def stalled_for(self, now: float) -> float | None:
        health = self.ctx.cfg.health
        times = [r["time"] for r in self.ctx.progress.records[-11:]]
        return stalled_for([t for t in times if t > self.ctx.steady_since], now,
                           health.stall_factor, health.stall_floor_s)

    def read_hosts(self, now: float) -> None:
        """Read every live host's beat (at most once per ``check_interval_s``, stretched as
        the hosts' beats are past the store's budget for them: a look reads every host's
        key, and the beats come no faster): a host's own beat, and its processes', move when
        a genuine newer value says so."""
        ctx, health = self.ctx, self.ctx.cfg.health
        every = health.check_interval_s * health.host_beat_interval_s(ctx.procs.nnodes) / \
            health.heartbeat_interval_s
        if now - self._hosts_read_at < every:
            return
        self._hosts_read_at = now
        nodes = [n for n in range(ctx.procs.nnodes) if n not in ctx.procs.lost]
        keys = [P.agent_key(n, "hb") for n in nodes]
        for node, key, raw in zip(nodes, keys, read_raw(ctx.store, keys)):
            if raw is None or raw == self._host_raw.get(node):
                continue                          # nothing new: nothing to decode
            self._host_raw[node] = raw
            payload = ctx.store.genuine(key, raw)
            try:
                beat = None if payload is None else P.read_message(P.HostBeat, payload)
            except P.MessageError as exc:
                ctx.events.emit("message_rejected", key=key, error=str(exc))
                beat = None
            seen = self._host_beats.get(node)
            if beat is None or seen is not None and not moved(seen[0], beat.pid, beat.seq):
                continue                          # junk, or an older genuine beat put back
            self._host_beats[node] = ((beat.pid, beat.seq), now)
            quiet = {}
            for name, entry in beat.quiet.items():
                if isinstance(entry, list) and len(entry) == 2 and \
                        all(isinstance(x, int) for x in entry):
                    quiet[name] = (entry[0], None if entry[1] < 0 else now - entry[1] / 1000)
            old = self._hosts.get(node)
            perf = (beat.pid, beat.perf)
            if beat.perf and (old is None or old.perf != perf):
                self._perf_moved.add(node)
            self._hosts[node] = HostView(beat.running, quiet, perf)

    def perf_moved(self) -> set[int]:
        """The hosts whose beats announced new step measurements since the last call
        (``P.HostPerf``: read by the straggler detector, ``control/stragglers.py``)."""
        moved, self._perf_moved = self._perf_moved, set()
        return moved

    def _beat(self, worker: str, read: bool = True) -> float | None:
        """Time the worker last beat (None before its first beat): when its host's newest
        beat was read, unless that beat lists it as quiet. ``read``: read the hosts' beats
        and its PID first; a loop over workers reads the hosts once and the PIDs in a batch
        (``learn_pids``), so not here again one round trip a worker."""
        if read:
            self.read_hosts(time.time())
        pid = self.ctx.procs.pid(worker) if read else self.ctx.procs.procs[worker].pid
        if pid is None:
            return None   # not started yet
        node = self.ctx.procs.procs[worker].node
        seen, host = self._host_beats.get(node), self._hosts.get(node)
        if seen is None or seen[0] is None or host is None:
            return None   # its host not heard yet
        entry = host.quiet.get(worker)
        if entry is None:
            return seen[1]
        if entry[0] != pid:
            return None   # a former incarnation listed: this one's beats only
        return entry[1]


def moved(seen: tuple[int, int] | None, pid: int, seq: int) -> bool:
    """Whether ``(pid, seq)`` is a beat after ``seen`` (the newest seen): of another
    process, or further in the same process's sequence."""
    return seen is None or seen[0] != pid or seq > seen[1]
