"""A host's heartbeat (``P.HostBeat``), written by a thread of its agent every heartbeat
interval: the agent's own beat, with the count of beats each of its running processes sent
on its channel to the agent (``worker/liveness.Heartbeat``). The store holds, and the
controller reads, one key a host instead of one a process.

A thread, not the agent's loop: the loop may be held for seconds by one spawn (the fork
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
        """Each running child's ``[pid, beats]``, its new beats read off its channel."""
        out = {}
        for c in self.children():
            channel = c.channel
            if channel is None or c.proc.pid is None or c.proc.returncode is not None:
                continue
            while True:
                try:
                    if not channel.recv(16):
                        break                    # its end closed: it is exiting
                    c.beats += 1
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:                  # closed by the agent as it reaped it
                    break
            out[c.name] = [c.proc.pid, c.beats]
        return out
