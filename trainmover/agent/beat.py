"""A host's heartbeat (``P.HostBeat``), written by a thread of its agent every heartbeat
interval: the agent's own beat, the number of its running processes, and those of them that
sent no beat on their channel to the agent (``worker/liveness.Heartbeat``) lately, with how
long. The store holds, and the controller reads, one key a host instead of one a process,
and a host's value is the size of its silence: a controller of 100K workers judges the few
processes listed instead of looking at every worker's count at every look.

The beats themselves are counted and timed as they arrive by the reader of the channels
(``agent/votes.Channels``). A thread, not the agent's loop: the loop may be held for seconds by one spawn (the fork
server's first, while it imports torch), and a host whose beat paused that long was
declared lost before its first step.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Callable

from trainmover.agent.perfs import Perfs
from trainmover.core import protocol as P


class HostBeat:
    def __init__(self, store, node: int, interval_s: float, quiet_after_s: float,
                 children: Callable[[], list], perfs: Perfs | None = None):
        """``children``: the agent's current ``Child`` records (read, never changed here:
        a child whose exit the agent recorded, or whose channel it closed, is left out).
        ``quiet_after_s``: a process silent longer is listed (``quiet_listed_s``).
        ``perfs``: the processes' step measurements, written for the host before a beat
        announces them (``agent/perfs.py``)."""
        self.store, self.node, self.interval_s = store, node, interval_s
        self.quiet_after_s = quiet_after_s
        self.children = children
        self.perfs = perfs
        self.seq = 0
        self.error: BaseException | None = None
        threading.Thread(target=self._loop, name=f"host-beat-{node}", daemon=True).start()

    def _loop(self) -> None:
        key = P.agent_key(self.node, "hb")
        try:
            while True:
                self.seq += 1        # a signed beat, not a counter anyone can bump
                names, quiet = self.summary(time.monotonic())
                perf = 0 if self.perfs is None else \
                    self.perfs.publish(self.store, self.node, names)
                self.store.set(key, P.write_message(P.HostBeat(self.seq, os.getpid(),
                                                               len(names), quiet, perf)))
                time.sleep(self.interval_s)
        except Exception as exc:  # noqa: BLE001 - the store is gone: the agent's loop learns
            self.error = exc

    def summary(self, now: float) -> tuple[set[str], dict[str, list[int]]]:
        """The children that run, and the quiet ones: ``{name: [pid, ms]}``, ``ms`` since
        the last beat that child sent (-1: none yet)."""
        running, quiet = set(), {}
        for c in self.children():
            if c.proc.pid is None or c.proc.returncode is not None:
                continue
            running.add(c.name)
            if c.beats == 0:
                quiet[c.name] = [c.proc.pid, -1]
            elif now - c.beat_at > self.quiet_after_s:
                quiet[c.name] = [c.proc.pid, int((now - c.beat_at) * 1000)]
        return running, quiet
