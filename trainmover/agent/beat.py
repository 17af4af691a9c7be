"""A host's heartbeat (``P.HostBeat``), written by a thread of its agent every heartbeat
interval: the agent's own beat, with the count of beats each of its running processes sent
on its channel to the agent (``worker/liveness.Heartbeat``). The store holds, and the
controller reads, one key a host instead of one a process.

The beats themselves are counted as they arrive by the reader of the channels
(``agent/votes.Channels``). A thread, not the agent's loop: the loop may be held for seconds by one spawn (the fork
server's first, while it imports torch), and a host whose beat paused that long was
declared lost before its first step.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Callable

from trainmover.core import protocol as P


class HostBeat:
    def __init__(self, store, node: int, interval_s: float, children: Callable[[], list]):
        """``children``: the agent's current ``Child`` records (read, never changed here:
        a child whose exit the agent recorded, or whose channel it closed, is left out)."""
        self.store, self.node, self.interval_s = store, node, interval_s
        self.children = children
        self.seq = 0
        self.error: BaseException | None = None
        threading.Thread(target=self._loop, name=f"host-beat-{node}", daemon=True).start()

    def _loop(self) -> None:
        key = P.agent_key(self.node, "hb")
        try:
            while True:
                self.seq += 1        # a signed beat, not a counter anyone can bump
                self.store.set(key, P.write_message(P.HostBeat(self.seq, os.getpid(),
                                                               self.counts())))
                time.sleep(self.interval_s)
        except Exception as exc:  # noqa: BLE001 - the store is gone: the agent's loop learns
            self.error = exc

    def counts(self) -> dict[str, list[int]]:
        """Each running child's ``[pid, beats]`` (its beats are counted as they come, by
        the reader of the channels: ``agent/votes.Channels``)."""
        return {c.name: [c.proc.pid, c.beats] for c in self.children()
                if c.proc.pid is not None and c.proc.returncode is None}
