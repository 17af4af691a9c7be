"""The controller's view of the job's agents (one per host): spawn and signal requests,
exit records, each host's liveness."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace

from trainmover.core import protocol as P
from trainmover.core.auth import read_valid
from trainmover.core.codec import Table
from trainmover.core.queues import SlotReader


@dataclass(frozen=True)
class ProcView:
    """One incarnation of a process, as the controller knows it: replaced, never changed in
    place (the process table is a ``Table``, encoded again only when it changed)."""

    standby: bool
    incarnation: int
    node: int = 0                # the host whose agent runs it
    pid: int | None = None       # None until the agent confirmed the start
    code: int | None = None      # exit code of this incarnation; None while it runs


@dataclass
class AgentClient:
    """What the controller knows of the agents' processes, refreshed once per poll from the
    agents' exit records. Its whole state is plain data, part of the controller's snapshot
    (the store client is not: a resumed controller sets its own)."""

    store: object = None
    log_dir: str = ""                             # where the agents write <name>.log
    procs: dict = field(default_factory=Table)    # name -> ProcView
    exits_seen: int = 0
    nnodes: int = 1
    lost: list = field(default_factory=list)      # hosts declared lost (fenced)
    events: object = None                         # the controller's event log
    exit_reader: object = None                    # reads the exit records (transient)
    # the processes whose current incarnation exited non-zero (or whose host was lost): an
    # index of ``procs`` (transient: rebuilt from it after a resume), so that finding the
    # round's crashes is no loop over every process
    failed_index: set | None = None
    __snapshot_exclude__ = ("store", "events", "exit_reader", "failed_index")

    def __post_init__(self) -> None:
        if not isinstance(self.procs, Table):      # read back from an older snapshot
            self.procs = Table(self.procs)

    def spawn_request(self, name: str, standby: bool, node: int = 0, gpu: int | None = None,
                      **restart) -> tuple[int, P.AgentSpawn]:
        """Record a new incarnation of ``name`` on host ``node`` and return the request that
        starts it (the controller sends it only after saving its snapshot)."""
        old = self.procs.get(name)
        view = ProcView(standby, (old.incarnation if old else 0) + 1, node)
        self.procs[name] = view
        self.failed().discard(name)
        return node, P.AgentSpawn(name, view.incarnation, standby, gpu, **restart)

    def send(self, node: int, request: P.AgentRequest) -> None:
        index = self.store.add(P.agent_key(node, "req/count"), 1)
        self.store.set(P.agent_request_key(node, index), P.encode_agent_request(request))

    def mark_lost(self, node: int) -> list[str]:
        """Host ``node`` is lost: each of its processes counts as exited (SIGKILL's code),
        since no agent will report them. Returns their names."""
        if node not in self.lost:
            self.lost.append(node)
        names = [n for n, v in self.procs.items() if v.node == node]
        for n in names:
            if self.procs[n].code is None:
                self.procs[n] = replace(self.procs[n], code=-9)
            if self.procs[n].code != 0:
                self.failed().add(n)
        return names

    def failed(self) -> set:
        """The names whose current incarnation exited non-zero or was lost with its host
        (``failed_index``)."""
        if self.failed_index is None:
            self.failed_index = {n for n, v in self.procs.items()
                                 if v.code is not None and v.code != 0}
        return self.failed_index

    def refresh(self) -> list[tuple[str, int | None]]:
        """Read the agents' new exit records; returns (name, pid) of the processes that
        exited (pid None if it was never known)."""
        exited = []
        reader = self.exit_reader
        if reader is None or reader.store is not self.store or \
                reader.next_index != self.exits_seen + 1:
            # a numbered queue: a record the counter promises but nobody writes (a bumped
            # counter) is passed over, never waited for (it once blocked the controller)
            reader = self.exit_reader = SlotReader(
                self.store, P.agent_exit_key, count_key=P.AGENT_EXIT_COUNT_KEY,
                start=self.exits_seen + 1, on_reject=self._rejected)
        while (taken := reader.take()) is not None:
            key, raw = taken
            self.exits_seen = reader.next_index - 1
            try:
                rec = P.read_message(P.ExitRecord, raw)
            except P.MessageError as exc:
                self._rejected(key, str(exc))
                continue
            view = self.procs.get(rec.name)
            if view is not None and view.incarnation == rec.incarnation:
                self.procs[rec.name] = replace(view, code=rec.code)
                if rec.code != 0:
                    self.failed().add(rec.name)
                exited.append((rec.name, self.pid(rec.name)))
        return exited

    def known(self, name: str) -> bool:
        return name in self.procs

    def exit_code(self, name: str) -> int | None:
        """The exit code of the current incarnation; None while it runs (or is starting)."""
        return self.procs[name].code

    def running(self, name: str) -> bool:
        return name in self.procs and self.procs[name].code is None

    def pid(self, name: str) -> int | None:
        view = self.procs[name]
        if view.pid is None and self.store.check([P.agent_proc_key(name)]):
            info = self._read(P.ProcRecord, P.agent_proc_key(name))
            if info is not None and info.incarnation == view.incarnation:
                view = self.procs[name] = replace(view, pid=info.pid)
        return view.pid

    def learn_pids(self, names) -> None:
        """``pid`` of many processes at once: the records of those not known yet, in a few
        requests (one round trip each was most of a look at the job's start, when thousands
        of workers have none yet)."""
        unknown = [n for n in names if n in self.procs and self.procs[n].pid is None]
        keys = [P.agent_proc_key(n) for n in unknown]
        for name, key, raw in zip(unknown, keys, read_valid(self.store, keys)):
            if raw is None:
                continue
            try:
                info = P.read_message(P.ProcRecord, raw)
            except P.MessageError as exc:
                self._rejected(key, str(exc))
                continue
            view = self.procs[name]
            if info.incarnation == view.incarnation:
                self.procs[name] = replace(view, pid=info.pid)

    def _rejected(self, key: str, why: str) -> None:
        if self.events is not None:
            self.events.emit("message_rejected", key=key, error=why)

    def _read(self, cls, key: str):
        """An agent's record, or None (logged) if it is malformed, unsigned or forged."""
        try:
            return P.read_message(cls, self.store.get(key))
        except P.MessageError as exc:
            self._rejected(key, str(exc))
            return None

    def kill(self, name: str) -> None:
        """SIGKILL the current incarnation (the agent does it before its next request)."""
        view = self.procs[name]
        self.send(view.node, P.AgentSignal(name, view.incarnation, "KILL"))

    def stop(self, name: str, grace_s: float) -> None:
        """SIGTERM, then SIGKILL after ``grace_s``."""
        view = self.procs[name]
        self.send(view.node, P.AgentSignal(name, view.incarnation, "TERM", grace_s))

    def shutdown(self, grace_s: float, timeout_s: float) -> None:
        """Stop every process (SIGKILL after ``grace_s``) and every agent, host 0's (the
        built-in store's) last; returns once they are stopped, or ``timeout_s`` after the
        order went out. Every other host is told first and all of them stop at once: one
        host after another, each waited for up to ``timeout_s``, a failed job of thousands
        of hosts once took longer to stop than it had run."""
        from datetime import timedelta

        others = [n for n in range(1, self.nnodes) if n not in self.lost]
        for nodes in (others, [] if 0 in self.lost else [0]):
            told = []
            for node in nodes:
                try:
                    self.send(node, P.AgentShutdown(grace_s))
                    told.append(node)
                except Exception:  # noqa: BLE001 - the store is gone: nothing more to tell
                    break
            deadline = time.monotonic() + timeout_s
            for node in told:
                try:
                    self.store.wait([P.agent_key(node, "done")],
                                    timedelta(seconds=max(0.0, deadline - time.monotonic())))
                    self.store.set(P.agent_key(node, "done_ack"), "1")
                except Exception:  # noqa: BLE001 - that agent is gone already or too late
                    pass

    def tail(self, name: str, lines: int = 15) -> str:
        try:
            with open(os.path.join(self.log_dir, f"{name}.log"), errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except (OSError, KeyError):
            return ""
