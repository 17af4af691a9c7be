"""The job's key-value store: a server that answers only processes holding the run's key.

Why not torch's TCPStore: anyone on the machine can connect to its port (readable from
``ps``) and name, list, overwrite, bump or delete any key; one non-integer value at a key
another process ``add``s to makes the server drop that process's connection. Signing values
(``core/auth.py``) makes forgeries detectable, not harmless: a refused vote, order or counter
still stalls whoever waits on it. This store refuses the connection instead: a client proves
it holds the key before its first request, so a process without the job's secret can
neither read nor write anything, and the values the job's processes read are their own.

The handshake (a challenge both ways, so that a process listening on the port first cannot
pose as the store either)::

    server -> client   MAGIC, server nonce Ns (32 bytes)
    client -> server   client nonce Nc (32 bytes), HMAC(key, "client" Ns Nc)
    server -> client   HMAC(key, "server" Ns Nc)

A connection that has not completed it within ``handshake_timeout_s`` is closed, and only
``max_pending`` of them are kept (the oldest goes first): unauthenticated peers cost a few
file descriptors, never the server's attention. The key is per run (derived from the
secret and the run id), so nothing from another run or resume of the job gets in. What it
does not do: encrypt, or authenticate each message after the handshake. On one host only
root can read or inject loopback traffic; across hosts the job's network is trusted as
gloo's and NCCL's own traffic is (see the security docs).

After the handshake each request is one frame (a 4-byte length, then the body) and gets one
answer frame, in order. Semantics follow torch's ``Store``: ``get`` and ``wait`` block
until the keys exist or the request's timeout passes (waiting in the server, so a client
waits with one request instead of polling), ``add`` counts in decimal text,
``compare_set`` sets a missing key only when the expected value is empty, and ``set``,
``append`` and ``multi_set`` answer nothing (the writer goes on at once, as TCPStore's
does; what it sends next on the connection is answered after them). Unlike
TCPStore, ``add`` on a value that is not an integer answers an error and keeps the
connection. One thread serves every connection (the protocol's work per request is a dict
operation; the thread never blocks on a client).

Pure Python, no torch: ``comm/store.py`` adapts the client to ``torch.distributed.Store``
for the backends' own rendezvous."""
from __future__ import annotations

import collections
import hashlib
import heapq
import hmac
import os
import re
import selectors
import socket
import struct
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from enum import IntEnum

MAGIC = b"TMKV1"
NONCE_BYTES = 32
MAC_BYTES = 32
_FRAME = struct.Struct(">I")
# a request: op, timeout (ms), a number (add's delta), the count of byte-string fields
_REQUEST = struct.Struct(">BIqI")
# an answer: status, a number (add's result, a count, a flag), the count of fields
_ANSWER = struct.Struct(">BqI")
_FIELD = struct.Struct(">I")


class Op(IntEnum):
    SET = 1
    GET = 2
    ADD = 3
    COMPARE_SET = 4
    CHECK = 5
    WAIT = 6
    DELETE = 7
    NUM_KEYS = 8
    APPEND = 9
    MULTI_GET = 10
    MULTI_SET = 11
    LIST_KEYS = 12
    PING = 13
    TRY_GET = 14         # the value, or that there is none: no wait


# A writing request with this bit set in its op gets no answer: the writer goes on at once
# (as TCPStore's set does), and its later requests on the connection are answered after it.
NO_REPLY = 0x80
_NO_REPLY_OPS = (Op.SET, Op.APPEND, Op.MULTI_SET)


class Status(IntEnum):
    OK = 0
    TIMEOUT = 1
    ERROR = 2
    NOT_A_NUMBER = 3     # ``add`` on a value that is no integer


class StoreError(RuntimeError):
    """A store request failed (the connection is usable again unless it is ``StoreClosed``)."""


class StoreTimeout(StoreError):
    """The keys a request waited for did not appear within its timeout."""


class StoreNotANumber(StoreError):
    """``add`` found a value that is no integer at the key (the connection serves on)."""


class StoreClosed(StoreError):
    """The connection is gone (the server stopped, or refused this client)."""


class StoreRefused(StoreClosed):
    """The handshake failed: the peer does not hold the run's key (or is not a store)."""


def store_key(run_key: bytes) -> bytes:
    """The store's key for a run: its own derivation, so that a MAC made for the store can
    never be one the run's other uses of the key accept."""
    return hmac.new(run_key, b"trainmover key-value store v1", hashlib.sha256).digest()


def _mac(key: bytes, who: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(key, who + server_nonce + client_nonce, hashlib.sha256).digest()


@dataclass(frozen=True)
class StoreLimits:
    """What one connection may ask of the server. The defaults fit the job's largest value
    (the controller's snapshot, a gloo rendezvous list at thousands of ranks) with room."""
    handshake_timeout_s: float = 10.0      # an unauthenticated connection is closed after it
    max_pending: int = 64                  # unauthenticated connections kept (oldest closed)
    max_frame_bytes: int = 1 << 30         # a longer request closes its connection
    max_key_bytes: int = 4096

    @staticmethod
    def of(comm) -> "StoreLimits":
        """The limits a job's ``CommConfig`` sets."""
        return StoreLimits(handshake_timeout_s=comm.store_handshake_timeout_s,
                           max_pending=comm.store_max_pending)


def encode_request(op: Op, fields=(), number: int = 0, timeout_ms: int = 0) -> bytes:
    body = [_REQUEST.pack(op, timeout_ms, number, len(fields))]
    for f in fields:
        body.append(_FIELD.pack(len(f)))
        body.append(f)
    payload = b"".join(body)
    return _FRAME.pack(len(payload)) + payload


def _encode_answer(status: Status, number: int = 0, fields=()) -> bytes:
    body = [_ANSWER.pack(status, number, len(fields))]
    for f in fields:
        body.append(_FIELD.pack(len(f)))
        body.append(f)
    payload = b"".join(body)
    return _FRAME.pack(len(payload)) + payload


def _fields(body: memoryview, offset: int, count: int) -> list[bytes]:
    out = []
    for _ in range(count):
        if offset + 4 > len(body):
            raise ValueError("truncated field")
        (n,) = _FIELD.unpack_from(body, offset)
        offset += 4
        if offset + n > len(body):
            raise ValueError("truncated field")
        out.append(bytes(body[offset:offset + n]))
        offset += n
    if offset != len(body):
        raise ValueError("trailing bytes")
    return out


def decode_answer(body: bytes) -> tuple[Status, int, list[bytes]]:
    status, number, count = _ANSWER.unpack_from(body, 0)
    return Status(status), number, _fields(memoryview(body), _ANSWER.size, count)


_COUNT = re.compile(rb"-?[0-9]{1,19}")


def is_count(value: bytes) -> bool:
    """Whether ``value`` is a counter's value: decimal digits, optionally negative (or empty,
    which counts as 0, as torch's stores count it)."""
    return not value or _COUNT.fullmatch(value) is not None


def _as_int(value: bytes) -> int | None:
    """A counter's value, or None where torch's ``stoll`` would have read a prefix of it."""
    return (int(value) if value else 0) if is_count(value) else None


# --- server -------------------------------------------------------------------------------

class _Conn:
    __slots__ = ("sock", "inbuf", "outbuf", "authed", "nonce", "waiting", "closed")

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.inbuf = bytearray()
        self.outbuf = bytearray()
        self.authed = False
        self.nonce = os.urandom(NONCE_BYTES)
        self.waiting: _Wait | None = None     # a get/wait blocked on keys not yet there
        self.closed = False


class _Wait:
    __slots__ = ("op", "keys", "deadline")

    def __init__(self, op: Op, keys: list[bytes], deadline: float):
        self.op, self.keys, self.deadline = op, keys, deadline


class KVServer:
    """Serves the store on ``sock`` (a listening socket, e.g. inherited from the process that
    opened the port) from one daemon thread until ``close``."""

    def __init__(self, key: bytes, sock: socket.socket, limits: StoreLimits = StoreLimits()):
        self._key = key
        self._limits = limits
        self._listener = sock
        self._listener.setblocking(False)
        self._data: dict[bytes, bytes] = {}
        self._waiters: dict[bytes, set[_Conn]] = collections.defaultdict(set)
        self._deadlines: list[tuple[float, int, _Conn, object]] = []
        self._seq = 0
        self._pending: collections.OrderedDict[_Conn, float] = collections.OrderedDict()
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._stopping = False
        self.requests = 0          # requests served (the agent reports the count)
        self.refused = 0           # connections closed before or at the handshake
        self._thread = threading.Thread(target=self._serve, name="kvstore", daemon=True)
        self._thread.start()

    @classmethod
    def listen(cls, key: bytes, host: str = "127.0.0.1", port: int = 0,
               limits: StoreLimits = StoreLimits(), backlog: int = 1024) -> "KVServer":
        return cls(key, socket.create_server((host, port), backlog=backlog), limits)

    @property
    def port(self) -> int:
        return self._listener.getsockname()[1]

    def close(self) -> None:
        self._stopping = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(timeout=5)

    # -- the loop --------------------------------------------------------------------------

    def _serve(self) -> None:
        try:
            while not self._stopping:
                timeout = None
                if self._deadlines:
                    timeout = max(0.0, self._deadlines[0][0] - time.monotonic())
                for sk, events in self._sel.select(timeout):
                    if sk.data is None:
                        self._accept()
                    elif sk.data == "wake":
                        self._wake_r.recv(64)
                    else:
                        conn = sk.data
                        if events & selectors.EVENT_WRITE and not conn.closed:
                            self._flush(conn)
                        if events & selectors.EVENT_READ and not conn.closed:
                            self._read(conn)
                self._expire(time.monotonic())
        finally:
            for key in list(self._sel.get_map().values()):
                try:
                    key.fileobj.close()
                except OSError:
                    pass
            self._sel.close()
            self._wake_w.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:       # out of descriptors: the pending ones are the first to go
                if self._pending:
                    self._close(next(iter(self._pending)))
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(sock)
            self._sel.register(sock, selectors.EVENT_READ, conn)
            deadline = time.monotonic() + self._limits.handshake_timeout_s
            self._pending[conn] = deadline
            self._at(deadline, conn, "handshake")
            while len(self._pending) > self._limits.max_pending:
                self._close(next(iter(self._pending)))
            self._send(conn, MAGIC + conn.nonce)

    def _at(self, deadline: float, conn: _Conn, what) -> None:
        self._seq += 1
        heapq.heappush(self._deadlines, (deadline, self._seq, conn, what))

    def _expire(self, now: float) -> None:
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, conn, what = heapq.heappop(self._deadlines)
            if conn.closed:
                continue
            if what == "handshake":
                if not conn.authed:
                    self._close(conn)
            elif conn.waiting is what:
                self._unwait(conn)
                self._send(conn, _encode_answer(Status.TIMEOUT))
                self._process(conn)

    def _close(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        if not conn.authed:
            self.refused += 1
        self._pending.pop(conn, None)
        if conn.waiting is not None:
            self._unwait(conn)
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(1 << 20)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(conn)
            return
        conn.inbuf += data
        if not conn.authed:
            self._handshake(conn)
        if conn.authed and not conn.closed:
            self._process(conn)

    def _handshake(self, conn: _Conn) -> None:
        need = NONCE_BYTES + MAC_BYTES
        if len(conn.inbuf) < need:
            return
        client_nonce, mac = bytes(conn.inbuf[:NONCE_BYTES]), bytes(conn.inbuf[NONCE_BYTES:need])
        if not hmac.compare_digest(mac, _mac(self._key, b"client", conn.nonce, client_nonce)):
            self._close(conn)
            return
        del conn.inbuf[:need]
        conn.authed = True
        self._pending.pop(conn, None)
        self._send(conn, _mac(self._key, b"server", conn.nonce, client_nonce))

    def _send(self, conn: _Conn, data: bytes) -> None:
        if conn.closed:
            return
        if not conn.outbuf:
            try:
                sent = conn.sock.send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                self._close(conn)
                return
            if sent == len(data):
                return
            data = data[sent:]
            self._sel.modify(conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, conn)
        conn.outbuf += data

    def _flush(self, conn: _Conn) -> None:
        try:
            sent = conn.sock.send(conn.outbuf)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        del conn.outbuf[:sent]
        if not conn.outbuf:
            self._sel.modify(conn.sock, selectors.EVENT_READ, conn)

    def _process(self, conn: _Conn) -> None:
        """Answer the whole requests in ``conn``'s buffer, in order; a blocked one (a get or
        wait on missing keys) holds the rest until it is answered."""
        buf = conn.inbuf
        while conn.waiting is None and not conn.closed and len(buf) >= 4:
            (size,) = _FRAME.unpack_from(buf, 0)
            if size > self._limits.max_frame_bytes or size < _REQUEST.size:
                self._close(conn)
                return
            if len(buf) < 4 + size:
                return
            body = memoryview(bytes(buf[4:4 + size]))
            del buf[:4 + size]
            quiet = False
            try:
                op, timeout_ms, number, count = _REQUEST.unpack_from(body, 0)
                quiet = bool(op & NO_REPLY)
                op = Op(op & ~NO_REPLY)
                if quiet and op not in _NO_REPLY_OPS:
                    raise ValueError(f"{op.name} always answers")
                fields = _fields(body, _REQUEST.size, count)
                answer = self._handle(conn, op, timeout_ms, number, fields)
            except (ValueError, struct.error) as exc:
                if quiet:          # nobody to tell: the writer learns at its next request
                    self._close(conn)
                    return
                answer = _encode_answer(Status.ERROR, 0, [str(exc).encode()])
            self.requests += 1
            if answer is not None and not quiet:
                self._send(conn, answer)

    def _handle(self, conn: _Conn, op: Op, timeout_ms: int, number: int,
                fields: list[bytes]) -> bytes | None:
        data = self._data
        for_keys = fields if op in (Op.CHECK, Op.WAIT, Op.MULTI_GET, Op.DELETE, Op.GET,
                                    Op.TRY_GET) else \
            fields[::2] if op == Op.MULTI_SET else fields[:1]
        if any(len(k) > self._limits.max_key_bytes for k in for_keys):
            raise ValueError(f"a key longer than {self._limits.max_key_bytes} bytes")
        if op == Op.SET:
            key, value = _exactly(fields, 2)
            data[key] = value
            self._changed(key)
        elif op in (Op.GET, Op.WAIT, Op.MULTI_GET):
            keys = _exactly(fields, 1) if op == Op.GET else fields
            missing = [k for k in keys if k not in data]
            if missing:
                wait = _Wait(op, keys, time.monotonic() + timeout_ms / 1000)
                conn.waiting = wait
                for k in missing:
                    self._waiters[k].add(conn)
                self._at(wait.deadline, conn, wait)
                return None
            return self._ready(op, keys)
        elif op == Op.ADD:
            (key,) = _exactly(fields, 1)
            old = data.get(key, b"0")
            base = _as_int(old)
            if base is None:
                return _encode_answer(Status.NOT_A_NUMBER, 0, [
                    f"the value at {key[:200]!r} is not an integer".encode()])
            data[key] = str(base + number).encode()
            self._changed(key)
            return _encode_answer(Status.OK, base + number)
        elif op == Op.COMPARE_SET:
            key, expected, desired = _exactly(fields, 3)
            current = data.get(key)
            if current is None:
                if expected:
                    return _encode_answer(Status.OK, 0, [expected])
                current = data[key] = desired
                self._changed(key)
            elif current == expected:
                current = data[key] = desired
                self._changed(key)
            return _encode_answer(Status.OK, 0, [current])
        elif op == Op.CHECK:
            return _encode_answer(Status.OK, int(all(k in data for k in fields)))
        elif op == Op.DELETE:
            (key,) = _exactly(fields, 1)
            return _encode_answer(Status.OK, int(data.pop(key, None) is not None))
        elif op == Op.NUM_KEYS:
            return _encode_answer(Status.OK, len(data))
        elif op == Op.APPEND:
            key, value = _exactly(fields, 2)
            data[key] = data.get(key, b"") + value
            self._changed(key)
        elif op == Op.MULTI_SET:
            if len(fields) % 2:
                raise ValueError("multi_set needs key, value pairs")
            for key, value in zip(fields[::2], fields[1::2]):
                data[key] = value
                self._changed(key)
        elif op == Op.LIST_KEYS:
            return _encode_answer(Status.OK, 0, list(data))
        elif op == Op.TRY_GET:
            (key,) = _exactly(fields, 1)
            value = data.get(key)
            return _encode_answer(Status.OK, 0) if value is None else \
                _encode_answer(Status.OK, 1, [value])
        elif op != Op.PING:
            raise ValueError(f"unknown op {op}")
        return _encode_answer(Status.OK)

    def _ready(self, op: Op, keys: list[bytes]) -> bytes:
        if op == Op.WAIT:
            return _encode_answer(Status.OK)
        return _encode_answer(Status.OK, 0, [self._data[k] for k in keys])

    def _changed(self, key: bytes) -> None:
        """A key was written: answer the requests that waited for it (and now have all of
        theirs), then what their connections sent meanwhile."""
        conns = self._waiters.pop(key, None)
        if not conns:
            return
        for conn in conns:
            wait = conn.waiting
            if wait is None or conn.closed:
                continue
            missing = [k for k in wait.keys if k not in self._data]
            if missing:       # still waiting (for a key deleted since, too)
                for k in missing:
                    self._waiters[k].add(conn)
                continue
            self._unwait(conn)
            self._send(conn, self._ready(wait.op, wait.keys))
            self._process(conn)

    def _unwait(self, conn: _Conn) -> None:
        wait, conn.waiting = conn.waiting, None
        for k in wait.keys:
            waiters = self._waiters.get(k)
            if waiters is not None:
                waiters.discard(conn)
                if not waiters:
                    del self._waiters[k]


def _exactly(fields: list[bytes], n: int) -> list[bytes]:
    if len(fields) != n:
        raise ValueError(f"expected {n} fields, got {len(fields)}")
    return fields


# --- client -------------------------------------------------------------------------------

class KVClient:
    """One connection to the store. Thread-safe: requests are answered in order, so a
    thread's blocking ``get`` holds the others' requests behind it (give each thread its own
    client, as ``comm.groups.StoreClients`` does)."""

    def __init__(self, host: str, port: int, key: bytes, timeout_s: float,
                 connect_timeout_s: float | None = None):
        self.host, self.port = host, port
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._sock = self._connect(key, timeout_s if connect_timeout_s is None
                                   else connect_timeout_s)

    def _connect(self, key: bytes, timeout_s: float) -> socket.socket:
        """Connect and authenticate, retrying a refused connection until ``timeout_s`` (the
        server may not listen yet: TCPStore's clients wait for it the same way)."""
        deadline = time.monotonic() + timeout_s
        delay = 0.01
        while True:
            try:
                sock = socket.create_connection((self.host, self.port),
                                                timeout=max(0.1, deadline - time.monotonic()))
                break
            except OSError as exc:
                if time.monotonic() + delay > deadline:
                    raise StoreClosed(f"cannot connect to the store at {self.host}:{self.port}"
                                      f" within {timeout_s} s: {exc}") from exc
                time.sleep(delay)
                delay = min(delay * 2, 0.5)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            hello = _recv_exactly(sock, len(MAGIC) + NONCE_BYTES)
            if hello[:len(MAGIC)] != MAGIC:
                raise StoreRefused(f"{self.host}:{self.port} is not a trainmover store")
            server_nonce, client_nonce = hello[len(MAGIC):], os.urandom(NONCE_BYTES)
            sock.sendall(client_nonce + _mac(key, b"client", server_nonce, client_nonce))
            proof = _recv_exactly(sock, MAC_BYTES)
            if not hmac.compare_digest(proof, _mac(key, b"server", server_nonce,
                                                   client_nonce)):
                raise StoreRefused(f"the store at {self.host}:{self.port} does not hold this "
                                   f"run's key")
        except StoreRefused:
            sock.close()
            raise
        except StoreClosed as exc:     # it hung up on the proof: not this run's key
            sock.close()
            raise StoreRefused(f"the store at {self.host}:{self.port} refused this client "
                               f"(not this run's key?)") from exc
        except OSError as exc:
            sock.close()
            raise StoreClosed(f"store handshake with {self.host}:{self.port}: {exc}") from exc
        return sock

    @property
    def timeout(self) -> timedelta:
        """How long a blocking request waits (as a torch store's ``timeout``)."""
        return timedelta(seconds=self.timeout_s)

    def close(self) -> None:
        self._sock.close()

    def _call(self, op: Op, fields=(), number: int = 0, wait_s: float | None = None
              ) -> tuple[int, list[bytes]]:
        timeout_ms = 0 if wait_s is None else max(0, int(wait_s * 1000))
        request = encode_request(op, fields, number, timeout_ms)
        with self._lock:
            try:
                # the server answers a wait at its timeout: the socket's is a margin later
                self._sock.settimeout(self.timeout_s + (wait_s or 0) + 5)
                self._sock.sendall(request)
                (size,) = _FRAME.unpack(_recv_exactly(self._sock, 4))
                status, number, out = decode_answer(_recv_exactly(self._sock, size))
            except OSError as exc:
                self._sock.close()
                raise StoreClosed(f"store at {self.host}:{self.port}: {exc}") from exc
        if status == Status.TIMEOUT:
            raise StoreTimeout(f"store wait timed out after {wait_s} s, keys: "
                               + ", ".join(f.decode(errors="replace") for f in fields
                                           if op != Op.MULTI_SET)[:500])
        if status in (Status.ERROR, Status.NOT_A_NUMBER):
            kind = StoreNotANumber if status == Status.NOT_A_NUMBER else StoreError
            raise kind(out[0].decode(errors="replace") if out else "store error")
        return number, out

    def _tell(self, op: Op, fields) -> None:
        """A write that waits for no answer (``NO_REPLY``)."""
        request = encode_request(op | NO_REPLY, fields)
        with self._lock:
            try:
                self._sock.settimeout(self.timeout_s)
                self._sock.sendall(request)
            except OSError as exc:
                self._sock.close()
                raise StoreClosed(f"store at {self.host}:{self.port}: {exc}") from exc

    def set(self, key: str, value: bytes | str) -> None:
        self._tell(Op.SET, [_b(key), _b(value)])

    def try_get(self, key: str) -> bytes | None:
        """The key's value, or None if it has none (one round trip, no wait)."""
        found, out = self._call(Op.TRY_GET, [_b(key)])
        return out[0] if found else None

    def get(self, key: str, timeout: float | timedelta | None = None) -> bytes:
        return self._call(Op.GET, [_b(key)], wait_s=self._wait(timeout))[1][0]

    def add(self, key: str, delta: int) -> int:
        return self._call(Op.ADD, [_b(key)], number=int(delta))[0]

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        return self._call(Op.COMPARE_SET, [_b(key), _b(expected), _b(desired)])[1][0]

    def check(self, keys: list[str]) -> bool:
        return bool(self._call(Op.CHECK, [_b(k) for k in keys])[0])

    def wait(self, keys: list[str], timeout: float | timedelta | None = None) -> None:
        self._call(Op.WAIT, [_b(k) for k in keys], wait_s=self._wait(timeout))

    def delete_key(self, key: str) -> bool:
        return bool(self._call(Op.DELETE, [_b(key)])[0])

    def num_keys(self) -> int:
        return self._call(Op.NUM_KEYS)[0]

    def append(self, key: str, value: bytes | str) -> None:
        self._tell(Op.APPEND, [_b(key), _b(value)])

    def multi_get(self, keys: list[str], timeout: float | timedelta | None = None
                  ) -> list[bytes]:
        return self._call(Op.MULTI_GET, [_b(k) for k in keys], wait_s=self._wait(timeout))[1]

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        if len(keys) != len(values):
            raise ValueError(f"multi_set: {len(keys)} keys but {len(values)} values")
        self._tell(Op.MULTI_SET, [_b(x) for kv in zip(keys, values) for x in kv])

    def list_keys(self) -> list[str]:
        return [k.decode(errors="replace") for k in self._call(Op.LIST_KEYS)[1]]

    def ping(self) -> None:
        self._call(Op.PING)

    def _wait(self, timeout: float | timedelta | None) -> float:
        """A wait's limit: the client's own, or the one given (seconds, or a timedelta as
        torch's stores take it)."""
        if timeout is None:
            return self.timeout_s
        return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)


def _b(x: bytes | str) -> bytes:
    return x.encode() if isinstance(x, str) else bytes(x)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise StoreClosed("connection closed by the store")
        buf += chunk
    return bytes(buf)


def connect(host: str, port: int, run_key: bytes, timeout_s: float,
            connect_timeout_s: float | None = None) -> KVClient:
    """A client of the store of the run ``run_key`` belongs to (torch-free: the controller
    and the CLI; torch's backends get ``comm.store.KVStore``)."""
    return KVClient(host, port, store_key(run_key), timeout_s, connect_timeout_s)


def serve(run_key: bytes, host: str = "127.0.0.1", port: int = 0,
          listen_fd: int | None = None, limits: StoreLimits = StoreLimits()) -> KVServer:
    """The store of the run ``run_key`` belongs to, served from a thread of this process: on
    the listening socket ``listen_fd`` (opened by the process that chose the port) or a new
    one at ``host:port`` (0: a free port)."""
    if listen_fd is not None:
        return KVServer(store_key(run_key), socket.socket(fileno=listen_fd), limits)
    return KVServer.listen(store_key(run_key), host, port, limits)
