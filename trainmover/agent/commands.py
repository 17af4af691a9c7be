"""The host's agent as the relay of the controller's commands to its processes.

Why: each worker read its own numbered command keys (``cmd/<worker>/<n>``), a store
connection each held waiting for the next one, and a recovery wrote a command a worker:
at 16K workers, 16K waits held open in the store's one thread and 16K keys written, read
and deleted to start one recovery. Here the controller writes one message a host per round
(``agent/<node>/cmd/<n>``: ``HostCommands``, the round's commands to that host's processes,
in order); the agent reads it as it reads its requests (a numbered queue, ``SlotReader``: a
forged head is not consumed), deletes it, and hands each command to the named process on
its channel (``c <command>``), which only the process and the agent hold.

What it keeps from the worker's own reading (``worker/commands.CommandChannel``): only
the controller's signed values are read; a command the protocol does not define is
dropped, loudly, never half-obeyed (checked here and again by the process); a process
gets its commands in the order they were sent. A command for a process the agent has not
started yet (its spawn request is read by another thread) waits for it up to
``HOLD_S``; one for a process that exited is dropped, as its keys were.
"""
from __future__ import annotations

import collections
import threading
import time
from typing import Callable

from trainmover.core import protocol as P
from trainmover.core.queues import SlotReader, take_or_wait

# How often undelivered commands are offered again (a full channel, a process not started
# yet), and how long one waits for its process to be started before it is dropped.
RESEND_S = 0.01
HOLD_S = 60.0


class CommandRelay:
    """Reads host ``node``'s command messages with ``store`` (its own client) and hands
    each command to ``deliver(name, message)``, which says ``"sent"``, ``"later"`` (its
    channel is full: offered again while the process lives), ``"unknown"`` (no such process
    yet: offered again up to ``HOLD_S``) or ``"gone"`` (the process exited: dropped).
    ``on_reject(key, why)`` hears of what was refused or dropped."""

    def __init__(self, store, node: int, deliver: Callable[[str, bytes], str],
                 on_reject: Callable[[str, str], None]):
        self.store, self.node = store, node
        self.deliver, self.on_reject = deliver, on_reject
        self.error: BaseException | None = None      # the store is gone
        self._cv = threading.Condition()
        # per process, its commands not delivered yet, in order: (message, held since)
        self._pending: dict[str, collections.deque] = {}
        threading.Thread(target=self._read, name=f"commands-{node}", daemon=True).start()
        threading.Thread(target=self._deliver, name=f"command-relay-{node}",
                         daemon=True).start()

    def _read(self) -> None:
        store = self.store
        reader = SlotReader(store, lambda i: P.host_command_key(self.node, i),
                            on_reject=self.on_reject)
        try:
            while True:
                # no holes to look for (the controller numbers the messages itself, no
                # counter): one wait until the next comes, re-armed only after
                # ``IDLE_WAIT_S`` (a wait re-armed every second was a request a host a
                # second, 770/s at 256 hosts)
                taken = take_or_wait(reader, store, P.IDLE_WAIT_S)
                if taken is None:
                    continue
                key, raw = taken
                store.delete_key(key)       # read once: nobody reads it again
                self._take(key, raw)
        except Exception as exc:  # noqa: BLE001 - the store is gone: the agent learns of it
            self.error = exc

    def _take(self, key: str, raw: bytes) -> None:
        try:
            message = P.read_message(P.HostCommands, raw)
        except P.MessageError as exc:
            self.on_reject(key, str(exc))
            return
        now = time.monotonic()
        with self._cv:
            for name, command in message.commands:
                try:
                    P.decode_command(command)
                except P.MessageError as exc:
                    # never half-obeyed: a message the protocol does not define is dropped
                    self.on_reject(f"{key} ({name})", str(exc))
                    continue
                self._pending.setdefault(name, collections.deque()).append(
                    (P.command_message(command), now))
            self._cv.notify()

    def _deliver(self) -> None:
        while True:
            with self._cv:
                while not self._pending:
                    self._cv.wait()
                names = list(self._pending)
            waiting = False
            for name in names:
                waiting |= self._offer(name)
            if waiting:
                time.sleep(RESEND_S)

    def _offer(self, name: str) -> bool:
        """Deliver what ``name`` has pending, in order; whether some of it must wait."""
        while True:
            with self._cv:
                queue = self._pending.get(name)
                if not queue:
                    self._pending.pop(name, None)
                    return False
                message, since = queue[0]
            went = self.deliver(name, message)
            if went == "later" or (went == "unknown" and time.monotonic() - since < HOLD_S):
                return True
            if went == "unknown":
                self.on_reject(name, f"a command waited {HOLD_S:.0f} s for its process "
                                     f"to start and was dropped")
            with self._cv:
                queue.popleft()
