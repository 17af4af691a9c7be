"""The controller's view of the job's agent: spawn and signal requests, exit records."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from trainmover.core import protocol as P

@dataclass
class ProcView:
    standby: bool
    incarnation: int
    pid: int | None = None       # None until the agent confirmed the start
    code: int | None = None      # exit code of this incarnation; None while it runs


@dataclass
class AgentClient:
    """What the controller knows of the agent's processes, refreshed once per poll from the
    agent's exit records. Its whole state is plain data, part of the controller's snapshot
    (the store client is not: a resumed controller sets its own)."""

    store: object = None
    log_dir: str = ""                             # where the agent writes <name>.log
    procs: dict = field(default_factory=dict)     # name -> ProcView
    exits_seen: int = 0
    __snapshot_exclude__ = ("store",)

    def spawn_request(self, name: str, standby: bool, gpu: int | None = None,
                      **restart) -> P.AgentSpawn:
        """Record a new incarnation of ``name`` and return the request that starts it (the
        controller sends it only after saving its snapshot)."""
        old = self.procs.get(name)
        view = ProcView(standby, (old.incarnation if old else 0) + 1)
        self.procs[name] = view
        return P.AgentSpawn(name, view.incarnation, standby, gpu, **restart)

    def send(self, request: P.AgentRequest) -> None:
        index = self.store.add(P.AGENT_REQUEST_COUNT_KEY, 1)
        self.store.set(P.agent_request_key(index), P.encode_agent_request(request))

    def refresh(self) -> None:
        count = self.store.add(P.AGENT_EXIT_COUNT_KEY, 0)
        while self.exits_seen < count:
            self.exits_seen += 1
            rec = P.read_message(P.ExitRecord,
                                 self.store.get(P.agent_exit_key(self.exits_seen)))
            view = self.procs.get(rec.name)
            if view is not None and view.incarnation == rec.incarnation:
                view.code = rec.code

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
            info = P.read_message(P.ProcRecord, self.store.get(P.agent_proc_key(name)))
            if info.incarnation == view.incarnation:
                view.pid = info.pid
        return view.pid

    def kill(self, name: str) -> None:
        """SIGKILL the current incarnation (the agent does it before its next request)."""
        self.send(P.AgentSignal(name, self.procs[name].incarnation, "KILL"))

    def stop(self, name: str, grace_s: float) -> None:
        """SIGTERM, then SIGKILL after ``grace_s``."""
        self.send(P.AgentSignal(name, self.procs[name].incarnation, "TERM", grace_s))

    def shutdown(self, grace_s: float, timeout_s: float) -> None:
        """Stop every process (SIGKILL after ``grace_s``) and the agent; returns once they
        are stopped, or after ``timeout_s``."""
        from datetime import timedelta

        try:
            self.send(P.AgentShutdown(grace_s))
            self.store.wait([P.AGENT_DONE_KEY], timedelta(seconds=timeout_s))
            self.store.set(P.AGENT_DONE_ACK_KEY, "1")
        except Exception:  # noqa: BLE001 - the agent is gone already: nothing left to stop
            pass

    def tail(self, name: str, lines: int = 15) -> str:
        try:
            with open(os.path.join(self.log_dir, f"{name}.log"), errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except (OSError, KeyError):
            return ""
