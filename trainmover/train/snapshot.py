"""A worker's side of the in-memory peer snapshots (``trainmover.core.snapshots`` has the why
and the wire protocol): send the role's state to its holder every few steps, and fetch a
role's state back in a recovery.

The only synchronous part is the copy to host memory at the step boundary (as for a disk
checkpoint); serializing and sending run in a background thread, at most one in flight. A
send that fails (the holder's host is gone) is reported and skipped: the previous snapshot,
or a disk checkpoint, stays the recovery source, and training never waits for a holder.
"""
from __future__ import annotations

import io
import threading
import time

import torch

from trainmover.core import protocol as P
from trainmover.core.snapshots import SnapshotClient, SnapshotUnavailable

# A role's state fetched back is checked against this bound before it is read (a holder
# sends what a worker sent it: the bound only stops a broken frame early).
MAX_FETCH_BYTES = 1 << 40


def holder_address(store, node: int, nnodes: int) -> str | None:
    """The snapshot holder for a worker on host ``node``: the next host's (so a lost host's
    roles are held elsewhere), passing over hosts declared lost; with one host, its own."""
    for i in range(1, nnodes + 1):
        n = (node + i) % nnodes
        if store.valid(P.agent_key(n, "fenced")) is not None:    # the controller's word
            continue
        address = store.valid(P.agent_key(n, "snapshots"))
        if address is not None:
            return address.decode()
    return None


class PeerSnapshotter:
    """Sends one role's state to its holder (``send``); ``on_event`` reports each outcome."""

    def __init__(self, role_name: str, store, secret: bytes, node: int, nnodes: int,
                 connect_timeout_s: float, io_timeout_s: float, on_event):
        self.role_name, self.store, self.secret = role_name, store, secret
        self.node, self.nnodes = node, nnodes
        self.timeouts = (connect_timeout_s, io_timeout_s)
        self.on_event = on_event
        self._thread: threading.Thread | None = None

    def send(self, step: int, epoch: int, tensors: dict) -> float:
        """Copy now, send in the background. Returns the synchronous seconds."""
        t0 = time.perf_counter()
        self.wait()
        copy = {k: v.detach().to("cpu", copy=True) for k, v in tensors.items()}
        self._thread = threading.Thread(target=self._send, args=(step, epoch, copy, t0),
                                        name=f"snapshot-{step}", daemon=True)
        self._thread.start()
        return time.perf_counter() - t0

    def _send(self, step: int, epoch: int, copy: dict, t0: float) -> None:
        buf = io.BytesIO()
        torch.save(copy, buf)
        del copy
        try:
            address = holder_address(self.store, self.node, self.nnodes)
            if address is None:
                raise SnapshotUnavailable("no live host serves snapshots")
            SnapshotClient(address, self.secret, *self.timeouts).put(
                self.role_name, step, epoch, buf.getbuffer())
        except (SnapshotUnavailable, OSError) as exc:
            self.on_event("snapshot_failed", step=step, error=str(exc), level="warning")
            return
        self.on_event("snapshot_sent", step=step, holder=address, bytes=buf.tell(),
                      duration_s=round(time.perf_counter() - t0, 4))

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None


def fetch_snapshot(address: str, secret: bytes, role_name: str, step: int,
                   connect_timeout_s: float, io_timeout_s: float) -> dict[str, torch.Tensor]:
    """A role's state before ``step`` from the holder at ``address`` (checked end to end);
    raises ``SnapshotUnavailable`` if it cannot be had."""
    client = SnapshotClient(address, secret, connect_timeout_s, io_timeout_s)
    _, blob = client.get(role_name, step, MAX_FETCH_BYTES)
    return torch.load(io.BytesIO(blob), weights_only=True)
