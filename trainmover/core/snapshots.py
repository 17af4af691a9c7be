"""In-memory peer snapshots: the wire protocol between workers (and the controller) and the
snapshot holders, and the pure choice of a usable snapshot. No torch: a snapshot is bytes.

Why: a role without a live data-parallel replica (a pipeline-only job) can only be restored
from a copy of its state taken earlier. Disk checkpoints are that copy, but they are taken
rarely (their cost is a file write per role) and a recovery from one reads the disk. So
every ``snapshot.every`` steps each worker of such a job also sends its state, serialized,
into the memory of a holder on another host (the agent of the next host; with one host,
that host's agent, which outlives any worker). A recovery then rolls every role back to the
newest step all roles hold a snapshot of (in one epoch), fetched from memory: at most
``snapshot.every`` steps are replayed and no disk is touched. The order of sources is: live
replica, peer snapshot, disk checkpoint (the initial state, step 0, is one of those).

Wire: one frame per request and per reply, ``!QQ`` (sealed header length, payload length),
the header (JSON, sealed with the job's secret under ``KEY_REQUEST``/``KEY_REPLY``, so one
cannot be replayed as the other), then the payload. A payload's sha256 is in the sealed
header and checked by whoever receives it. So nobody without the secret can store, fetch or
alter a snapshot through the holder's port (which, like the store's, stays on the job's
private network).
"""
from __future__ import annotations

import hashlib
import json
import socket
import struct
from dataclasses import asdict, dataclass, field

from trainmover.core.auth import seal, unseal

KEY_REQUEST = "snapshot/request"
KEY_REPLY = "snapshot/reply"
_FRAME = struct.Struct("!QQ")
MAX_HEADER_BYTES = 1 << 20


class SnapshotUnavailable(RuntimeError):
    """A holder cannot be reached, refuses, or does not hold the snapshot asked for."""


@dataclass(frozen=True)
class Entry:
    """One snapshot a holder keeps: ``role``'s state before ``step``, taken in ``epoch``."""

    role: str
    step: int
    epoch: int
    bytes: int
    sha256: str


@dataclass(frozen=True)
class Request:
    op: str                         # "put" | "get" | "list"
    role: str = ""
    step: int = -1
    epoch: int = -1
    bytes: int = 0
    sha256: str = ""

    def __post_init__(self) -> None:
        if self.op not in ("put", "get", "list"):
            raise ValueError(f"snapshot request op {self.op!r}")


@dataclass(frozen=True)
class Reply:
    ok: bool
    error: str = ""
    entry: Entry | None = None            # "get": the snapshot's entry (payload follows)
    entries: list[Entry] = field(default_factory=list)   # "list"


def encode(obj) -> bytes:
    return json.dumps(asdict(obj), sort_keys=True).encode()


def decode_request(raw: bytes) -> Request:
    try:
        return Request(**json.loads(raw))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"malformed snapshot request: {exc}") from exc


def decode_reply(raw: bytes) -> Reply:
    try:
        d = json.loads(raw)
        entry = Entry(**d["entry"]) if d.get("entry") else None
        entries = [Entry(**e) for e in d.get("entries", [])]
        return Reply(bool(d["ok"]), str(d.get("error", "")), entry, entries)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"malformed snapshot reply: {exc}") from exc


def send_frame(sock: socket.socket, secret: bytes, key: str, header: bytes,
               payload: bytes | memoryview = b"") -> None:
    sealed = seal(secret, key, header)
    sock.sendall(_FRAME.pack(len(sealed), len(payload)) + sealed)
    if payload:
        sock.sendall(payload)


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError(f"connection closed after {got} of {n} bytes")
        got += k
    return buf


def recv_frame(sock: socket.socket, secret: bytes, key: str,
               max_payload: int) -> tuple[bytes, bytearray]:
    """One frame: its checked header and its payload (at most ``max_payload`` bytes)."""
    head_len, payload_len = _FRAME.unpack(bytes(_recv_exact(sock, _FRAME.size)))
    if head_len > MAX_HEADER_BYTES or payload_len > max_payload:
        raise ValueError(f"snapshot frame too large (header {head_len} B, payload "
                         f"{payload_len} B, at most {max_payload} B)")
    header = unseal(secret, key, bytes(_recv_exact(sock, head_len)))
    return header, _recv_exact(sock, payload_len)


class SnapshotClient:
    """Talks to one holder at ``address`` (``host:port``); a connection per call (a snapshot
    is sent every few steps, a fetch happens once per recovery)."""

    def __init__(self, address: str, secret: bytes, connect_timeout_s: float,
                 io_timeout_s: float):
        host, _, port = address.rpartition(":")
        self.address, self.host, self.port = address, host, int(port)
        self.secret = secret
        self.connect_timeout_s, self.io_timeout_s = connect_timeout_s, io_timeout_s

    def _call(self, req: Request, payload: bytes | memoryview = b"",
              max_reply: int = 0) -> tuple[Reply, bytearray]:
        try:
            with socket.create_connection((self.host, self.port),
                                          timeout=self.connect_timeout_s) as sock:
                sock.settimeout(self.io_timeout_s)
                send_frame(sock, self.secret, KEY_REQUEST, encode(req), payload)
                header, body = recv_frame(sock, self.secret, KEY_REPLY, max_reply)
        except (OSError, ValueError) as exc:
            raise SnapshotUnavailable(f"snapshot holder {self.address}: {exc}") from exc
        reply = decode_reply(header)
        if not reply.ok:
            raise SnapshotUnavailable(f"snapshot holder {self.address}: {reply.error}")
        return reply, body

    def put(self, role: str, step: int, epoch: int, blob: bytes | memoryview) -> None:
        digest = hashlib.sha256(blob).hexdigest()
        self._call(Request("put", role, step, epoch, len(blob), digest), blob)

    def get(self, role: str, step: int, max_bytes: int) -> tuple[Entry, bytearray]:
        """The snapshot's bytes, checked against the sha256 the holder sealed with them."""
        reply, body = self._call(Request("get", role, step), max_reply=max_bytes)
        entry = reply.entry
        if entry is None or len(body) != entry.bytes or \
                hashlib.sha256(body).hexdigest() != entry.sha256:
            raise SnapshotUnavailable(f"snapshot holder {self.address}: {role} step {step} "
                                      f"arrived altered or incomplete")
        return entry, body

    def list(self) -> list[Entry]:
        reply, _ = self._call(Request("list"))
        return reply.entries


def usable_snapshot(held: dict[str, list[Entry]], roles: list[str],
                    max_step: int) -> tuple[int, dict[str, str]] | None:
    """The newest step, at most ``max_step``, of which every role's snapshot is held (taken
    in one epoch, so the set is one consistent cut of the job even after a rollback), and
    the holder of each role's; None when there is none. ``held``: holder address -> its
    entries."""
    by_step: dict[int, dict[str, list[tuple[int, str]]]] = {}
    for address, entries in sorted(held.items()):
        for e in entries:
            by_step.setdefault(e.step, {}).setdefault(e.role, []).append((e.epoch, address))
    for step in sorted(by_step, reverse=True):
        if step > max_step:
            continue
        have = by_step[step]
        if any(r not in have for r in roles):
            continue
        epochs = set.intersection(*({epoch for epoch, _ in have[r]} for r in roles))
        if not epochs:
            continue
        epoch = max(epochs)
        return step, {r: next(a for e, a in have[r] if e == epoch) for r in roles}
    return None
