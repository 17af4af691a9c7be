"""The host's agent as the relay of its processes' step measurements (``P.StepPerf``, one a
straggler window, on each process's channel): one signed ``P.HostPerf`` a host, written by
the heartbeat thread (``agent/beat.py``) when a new window came, and announced by the beat
that follows it (``HostBeat.perf``).

Why: with every worker writing its own key and the controller reading every key every half
second, the straggler detector alone cost the job's one store N reads each half second
(200K a second at 100K workers) for values that change once a window. Here the store sees
one write a host a window, and the controller reads only the hosts whose announced
``seq`` moved: requests in hosts, not workers, and none between windows.
"""
from __future__ import annotations

import threading
from typing import Callable

from trainmover.core import protocol as P


class Perfs:
    def __init__(self, on_reject: Callable[[str, str], None] | None = None):
        """``on_reject(process, why)``: a process sent a measurement that is not one."""
        self.on_reject = on_reject
        self._lock = threading.Lock()
        self._latest: dict[str, P.StepPerf] = {}    # process -> its newest window
        self._changed = False
        self.seq = 0            # the newest HostPerf written (0: none yet)

    def received(self, name: str, payload: bytes) -> None:
        """Process ``name`` sent ``payload`` on its channel (the channels' reader thread).
        Decoded here, so that what the agent writes for its host is well formed whatever a
        process sent: a bad one is reported and dropped."""
        try:
            perf = P.read_message(P.StepPerf, payload)
        except P.MessageError as exc:
            if self.on_reject is not None:
                self.on_reject(name, str(exc))
            return
        with self._lock:
            self._latest[name] = perf
            self._changed = True

    def publish(self, store, node: int, running: set[str]) -> int:
        """Write the host's ``HostPerf`` if a window came since the last one (the beat
        thread, before its beat), with the ``running`` processes' newest windows only;
        returns the ``seq`` to announce."""
        with self._lock:
            if not self._changed:
                return self.seq
            self._changed = False
            for gone in [n for n in self._latest if n not in running]:
                del self._latest[gone]
            workers = dict(self._latest)
        store.set(P.agent_key(node, "perf"), P.write_message(P.HostPerf(self.seq + 1, workers)))
        self.seq += 1     # announced once written: a reader never looks for a newer one
        return self.seq
