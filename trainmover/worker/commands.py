"""A process's commands from the controller, as its host's agent relays them on its channel
(``agent/commands.py``), read in order; a process with nothing to do blocks in
``CommandChannel.next``, which notices a job whose store is gone."""
from __future__ import annotations

import queue

from trainmover.comm.groups import StoreClients
from trainmover.core.queues import drain

# How often ``CommandChannel.next``, while it blocks, checks that the job's store is still
# there (a ping: answered by its host's door, which closes every connection once it loses
# the store, so every waiting worker of a recovery costs the job's store nothing): a
# waiting worker notices within this that its job is gone.
STORE_CHECK_S = 1.0


class CommandChannel:
    """The controller's commands to this process, in the order they were sent: relayed by
    its host's agent on its channel (``agent/commands.py``) and read there by its ``Inbox``
    (a process no agent started gets none). The training loop polls them; a process with
    nothing to do blocks in ``next``."""

    def __init__(self, stores: StoreClients, inbox, worker: str, on_wait=None,
                 check_s: float | None = None):
        self.worker = worker
        self.queue: queue.Queue = inbox.commands if inbox is not None else queue.Queue()
        self._stores = stores
        self.on_wait = on_wait   # called as ``next`` waits (a sign its thread is alive)
        self.check_s = check_s      # None: STORE_CHECK_S

    @staticmethod
    def _store_alive(store) -> bool:
        try:
            store.ping()
            return True
        except Exception:  # noqa: BLE001
            return False

    def poll(self) -> list[dict]:
        return drain(self.queue)

    def next(self) -> dict:
        """Block until a command arrives; raise if the job's store has gone away."""
        while True:
            if self.on_wait is not None:
                self.on_wait()
            try:
                return self.queue.get(timeout=self.check_s or STORE_CHECK_S)
            except queue.Empty:
                if not self._store_alive(self._stores.get()):
                    raise RuntimeError(f"{self.worker}: the job's store is gone; exiting")
