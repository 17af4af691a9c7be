"""A host agent's watch of the job's controller (the host's side of its failover): the
agent of the controller's host restarts a controller whose process is gone; with the store
on etcd, the agents of the ``controller.successors`` hosts after the controller's watch its
beat and one takes over, after winning an election in the store, when it stays still. The
job is given up when no controller comes back within ``controller.grace_s``
(docs/failures.md)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

from trainmover.core import protocol as P
from trainmover.core.config import JobConfig
from trainmover.core.proc import pid_alive


class ControllerWatch:
    def __init__(self, run_dir: str, cfg: JobConfig, node: int, etcd: bool, events):
        self.run_dir, self.cfg, self.node, self.etcd = run_dir, cfg, node, etcd
        self.events = events
        self.store = None                            # the agent's client, once connected
        self.current: P.ControllerInfo | None = None  # the live controller, as last read
        self.controllers: list[subprocess.Popen] = []   # the ones this agent restarted
        self._lost_at: float | None = None
        self._read_at = 0.0
        self._beat_seen: bytes | None = None        # the controller's beat as last read
        self._beat_still_since = 0.0                # ... and since when it has not changed
        self._takeovers: set[tuple[int, int]] = set()   # (incarnation, rank) tried

    def alive(self, now: float) -> bool:
        """False once the job must end because no controller came back."""
        if now - self._read_at < self._check_s():
            return True
        self._read_at = now
        # one round trip (valid: absent or forged read as None), every controller_check_s
        raw = self.store.valid(P.CONTROLLER_KEY)
        if raw is not None:
            try:
                current = P.read_message(P.ControllerInfo, raw)
            except P.MessageError as exc:
                self.events.emit("message_rejected", key=P.CONTROLLER_KEY, error=str(exc))
                current = self.current
            if current != self.current:
                if self._lost_at is not None:
                    self.events.emit("controller_back", pid=current.pid,
                                     incarnation=current.incarnation,
                                     gap_s=round(time.time() - self._lost_at, 3))
                self.current, self._lost_at = current, None
        if self.current is None:
            return True
        if self.current.node != self.node:
            return self._watch_remote(self.current, now)
        if pid_alive(self.current.pid):
            return True
        policy = self.cfg.controller
        if self._lost_at is None:
            self._lost_at = time.time()
            self.events.emit("controller_lost", pid=self.current.pid,
                             incarnation=self.current.incarnation,
                             action=policy.restart)
            if policy.restart == "auto":
                if len(self.controllers) >= policy.max_restarts:
                    self.events.emit("job_abandoned", reason=f"the controller died "
                                     f"{len(self.controllers) + 1} times")
                    return False
                self._restart()
        elif time.time() - self._lost_at > policy.grace_s:
            self.events.emit("job_abandoned", reason=f"no controller for "
                             f"{policy.grace_s} s (controller.grace_s)")
            return False
        return True

    def next_check_in(self, now: float) -> float:
        """Seconds until ``alive`` reads the controller's record again."""
        return self._read_at + self._check_s() - now

    def _check_s(self) -> float:
        """How often the controller's record is read: often on its host and the hosts that
        would take over from it, seldom elsewhere (thousands of agents reading it every
        ``agent.controller_check_s`` would load the store with O(hosts) requests)."""
        current = self.current
        if current is None or current.node == self.node or not self.etcd or \
                1 <= (self.node - current.node) % self.cfg.hosts.nnodes <= \
                self.cfg.controller.successors:
            return self.cfg.agent.controller_check_s
        return self.cfg.controller.takeover_after_s

    def _watch_remote(self, current: P.ControllerInfo, now: float) -> bool:
        """The store on etcd, the controller on another host: its beat is watched, often by
        the agents of the ``controller.successors`` hosts after it, seldom by the others.
        The r-th successor starts a controller here once the beat has been still for r
        times ``controller.takeover_after_s`` (the controller's own agent restarts it
        sooner, if that host is alive), after winning the election for that incarnation and
        rank; the new controller's higher incarnation makes any old one step down. False
        (the job must end) once the beat has been still for ``controller.grace_s``."""
        if not self.etcd:
            return True
        policy = self.cfg.controller
        beat = self.store.valid(P.CONTROLLER_BEAT_KEY)
        if beat != self._beat_seen or self._beat_still_since == 0.0:
            self._beat_seen, self._beat_still_since = beat, now
            return True
        still = now - self._beat_still_since
        if still > policy.grace_s:
            self.events.emit("job_abandoned", reason=f"no controller has beaten for "
                             f"{still:.0f} s (controller.grace_s)")
            return False
        rank = (self.node - current.node) % self.cfg.hosts.nnodes
        if not 1 <= rank <= policy.successors or still < rank * policy.takeover_after_s or \
                (current.incarnation, rank) in self._takeovers:
            return True
        self._takeovers.add((current.incarnation, rank))
        key = f"{P.controller_takeover_key(current.incarnation)}/{rank}"
        won = self.store.compare_set(key, "", str(self.node)) == str(self.node).encode()
        self.events.emit("controller_silent", pid=current.pid, node=current.node,
                         incarnation=current.incarnation, still_s=round(still, 3),
                         rank=rank, takes_over=won, level="warning")
        if won:
            self._restart(takeover=True)
        return True

    def _restart(self, takeover: bool = False) -> None:
        log = os.path.join(self.run_dir, "logs", "controller.log")
        extra = ["--node", str(self.node), "--takeover"] if takeover else \
            ["--node", str(self.node)]
        with open(log, "ab") as out:
            # not tied to the agent's life: it shuts the agent down at the end of the job,
            # then writes the job's summary
            proc = subprocess.Popen(
                [sys.executable, "-m", "trainmover", "controller", "--resume", self.run_dir,
                 *extra], stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ))
        self.controllers.append(proc)
        self.events.emit("controller_restarted", pid=proc.pid, log=log, node=self.node,
                         takeover=takeover)
