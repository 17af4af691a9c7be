"""The agent's snapshot holder: keeps the newest in-memory snapshots of the roles whose
workers send them (``trainmover.core.snapshots`` has the why and the wire protocol).

Served by threads beside the agent's loop, one per connection: a worker sending a snapshot
never waits for the agent's supervision round, and the agent's loop never waits for a
transfer. Memory is bounded: ``keep`` steps per role (a new step replaces the oldest), so a
host holds about ``keep`` times the state of the roles whose holder it is.
"""
from __future__ import annotations

import hashlib
import socketserver
import threading

from trainmover.core import snapshots as S

# Whatever a role's state weighs, a frame larger than this is refused before it is read.
MAX_SNAPSHOT_BYTES = 1 << 40


class SnapshotHolder:
    """The snapshots themselves (no sockets: ``SnapshotServer`` serves them)."""

    def __init__(self, keep: int):
        self.keep = keep
        self._lock = threading.Lock()
        self._held: dict[str, dict[int, tuple[S.Entry, bytes]]] = {}

    def put(self, entry: S.Entry, blob: bytes) -> None:
        with self._lock:
            steps = self._held.setdefault(entry.role, {})
            old = steps.get(entry.step)
            if old is not None and old[0].epoch > entry.epoch:
                return   # a late sender from an aborted epoch: the newer copy stays
            steps[entry.step] = (entry, blob)
            for step in sorted(steps)[:-self.keep]:
                del steps[step]

    def get(self, role: str, step: int) -> tuple[S.Entry, bytes] | None:
        with self._lock:
            return self._held.get(role, {}).get(step)

    def entries(self) -> list[S.Entry]:
        with self._lock:
            return [e for steps in self._held.values() for e, _ in steps.values()]

    def held_bytes(self) -> int:
        with self._lock:
            return sum(e.bytes for steps in self._held.values() for e, _ in steps.values())


class _Handler(socketserver.BaseRequestHandler):
    server: "SnapshotServer"

    def handle(self) -> None:
        srv, sock = self.server, self.request
        sock.settimeout(srv.io_timeout_s)
        try:
            header, payload = S.recv_frame(sock, srv.secret, S.KEY_REQUEST, MAX_SNAPSHOT_BYTES)
            reply, body = self._answer(S.decode_request(header), payload)
        except (OSError, ValueError) as exc:
            # a forged, malformed or broken request: told (if it can still hear) and dropped;
            # it never reaches the agent's loop
            srv.on_error(f"{type(exc).__name__}: {exc}")
            reply, body = S.Reply(False, f"refused: {type(exc).__name__}"), b""
        try:
            S.send_frame(sock, srv.secret, S.KEY_REPLY, S.encode(reply), body)
        except OSError:
            pass

    def _answer(self, req: S.Request, payload: bytearray) -> tuple[S.Reply, bytes]:
        holder = self.server.holder
        if req.op == "put":
            entry = S.Entry(req.role, req.step, req.epoch, req.bytes, req.sha256)
            if len(payload) != req.bytes or hashlib.sha256(payload).hexdigest() != req.sha256:
                return S.Reply(False, f"{req.role} step {req.step}: payload does not match "
                                      f"its sealed size and sha256"), b""
            holder.put(entry, payload)   # kept as received: no second copy
            return S.Reply(True), b""
        if req.op == "get":
            got = holder.get(req.role, req.step)
            if got is None:
                return S.Reply(False, f"no snapshot of {req.role} at step {req.step}"), b""
            return S.Reply(True, entry=got[0]), got[1]
        return S.Reply(True, entries=holder.entries()), b""


class SnapshotServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: str, secret: bytes, keep: int, io_timeout_s: float,
                 on_error=lambda why: None):
        super().__init__((address, 0), _Handler)
        self.secret, self.io_timeout_s, self.on_error = secret, io_timeout_s, on_error
        self.holder = SnapshotHolder(keep)
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        host, port = self.server_address[:2]
        return f"{host}:{port}"

    def start(self) -> "SnapshotServer":
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.5},
                                        name="snapshot-holder", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self.shutdown()
            self._thread = None
        self.server_close()
