"""The job's store server (the protocol and its semantics: ``core/kvstore.py``): one thread
serves every connection, never blocking on one; a connection that has not proved the run's
key within the handshake's timeout is closed, and only ``max_pending`` such are kept."""
from __future__ import annotations

import collections
import heapq
import hmac
import os
import selectors
import socket
import struct
import threading
import time

from trainmover.core.kvstore import (FRAME, MAGIC, NO_REPLY, NO_REPLY_OPS, NONCE_BYTES,
                                     MAC_BYTES, REFUSED, REQUEST, Op, Status, StoreLimits, as_int,
                                     encode_answer, handshake_mac, parse_fields, store_key)

# With every descriptor taken by authenticated clients, the listener stays readable: the
# loop pauses this long before it tries to accept again.
ACCEPT_BACKOFF_S = 0.01


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
                else:             # nothing to free: do not spin on the readable listener
                    time.sleep(ACCEPT_BACKOFF_S)
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
                self._send(conn, encode_answer(Status.TIMEOUT))
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
        if not hmac.compare_digest(mac, handshake_mac(self._key, b"client", conn.nonce, client_nonce)):
            self._send(conn, REFUSED)     # said, so the client does not try again
            self._close(conn)
            return
        del conn.inbuf[:need]
        conn.authed = True
        self._pending.pop(conn, None)
        self._send(conn, handshake_mac(self._key, b"server", conn.nonce, client_nonce))

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
            (size,) = FRAME.unpack_from(buf, 0)
            if size > self._limits.max_frame_bytes or size < REQUEST.size:
                self._close(conn)
                return
            if len(buf) < 4 + size:
                return
            body = memoryview(bytes(buf[4:4 + size]))
            del buf[:4 + size]
            quiet = False
            try:
                op, timeout_ms, number, count = REQUEST.unpack_from(body, 0)
                quiet = bool(op & NO_REPLY)
                op = Op(op & ~NO_REPLY)
                if quiet and op not in NO_REPLY_OPS:
                    raise ValueError(f"{op.name} always answers")
                fields = parse_fields(body, REQUEST.size, count)
                answer = self._handle(conn, op, timeout_ms, number, fields)
            except (ValueError, struct.error) as exc:
                if quiet:          # nobody to tell: the writer learns at its next request
                    self._close(conn)
                    return
                answer = encode_answer(Status.ERROR, 0, [str(exc).encode()])
            self.requests += 1
            if answer is not None and not quiet:
                self._send(conn, answer)

    def _handle(self, conn: _Conn, op: Op, timeout_ms: int, number: int,
                fields: list[bytes]) -> bytes | None:
        data = self._data
        for_keys = fields if op in (Op.CHECK, Op.WAIT, Op.MULTI_GET, Op.DELETE, Op.GET,
                                    Op.TRY_GET, Op.TRY_MULTI_GET) else \
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
            base = as_int(old)
            if base is None:
                return encode_answer(Status.NOT_A_NUMBER, 0, [
                    f"the value at {key[:200]!r} is not an integer".encode()])
            data[key] = str(base + number).encode()
            self._changed(key)
            return encode_answer(Status.OK, base + number)
        elif op == Op.COMPARE_SET:
            key, expected, desired = _exactly(fields, 3)
            current = data.get(key)
            if current is None:
                if expected:
                    return encode_answer(Status.OK, 0, [expected])
                current = data[key] = desired
                self._changed(key)
            elif current == expected:
                current = data[key] = desired
                self._changed(key)
            return encode_answer(Status.OK, 0, [current])
        elif op == Op.CHECK:
            return encode_answer(Status.OK, int(all(k in data for k in fields)))
        elif op == Op.DELETE:
            (key,) = _exactly(fields, 1)
            return encode_answer(Status.OK, int(data.pop(key, None) is not None))
        elif op == Op.NUM_KEYS:
            return encode_answer(Status.OK, len(data))
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
            return encode_answer(Status.OK, 0, list(data))
        elif op == Op.TRY_GET:
            (key,) = _exactly(fields, 1)
            value = data.get(key)
            return encode_answer(Status.OK, 0) if value is None else \
                encode_answer(Status.OK, 1, [value])
        elif op == Op.TRY_MULTI_GET:
            # each value behind a byte that says whether there is one
            return encode_answer(Status.OK, 0, [b"\x00" if (v := data.get(k)) is None
                                                else b"\x01" + v for k in fields])
        elif op != Op.PING:
            raise ValueError(f"unknown op {op}")
        return encode_answer(Status.OK)

    def _ready(self, op: Op, keys: list[bytes]) -> bytes:
        if op == Op.WAIT:
            return encode_answer(Status.OK)
        return encode_answer(Status.OK, 0, [self._data[k] for k in keys])

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


def serve(run_key: bytes, host: str = "127.0.0.1", port: int = 0,
          listen_fd: int | None = None, limits: StoreLimits = StoreLimits()) -> KVServer:
    """The store of the run ``run_key`` belongs to, served from a thread of this process: on
    the listening socket ``listen_fd`` (opened by the process that chose the port) or a new
    one at ``host:port`` (0: a free port)."""
    if listen_fd is not None:
        return KVServer(store_key(run_key), socket.socket(fileno=listen_fd), limits)
    return KVServer.listen(store_key(run_key), host, port, limits)
