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

from trainmover.core.kvstore import (FRAME, MAGIC, MUXED, NO_REPLY, NO_REPLY_OPS, NONCE_BYTES,
                                     MAC_BYTES, REFUSED, REQUEST, STREAM, Op, Status,
                                     StoreLimits, as_int, encode_answer, handshake_mac,
                                     parse_fields, store_key, tag_answer)

# With every descriptor taken by authenticated clients, the listener stays readable: the
# loop pauses this long before it tries to accept again.
ACCEPT_BACKOFF_S = 0.01
# The most one read of a connection takes. Read into one buffer kept for the purpose: a
# plain ``recv`` of this size allocates (and then shrinks) as much on every call, which was
# ~17 us of a request's ~30 us in the store's one thread (``benchmarks/vote_hosts.py``).
READ_BYTES = 1 << 20


class _Conn:
    __slots__ = ("sock", "inbuf", "outbuf", "authed", "nonce", "streams", "closed", "held",
                 "events")

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.inbuf = bytearray()
        self.outbuf = bytearray()
        # not read while set: its answers are not taken (``StoreLimits.max_unsent_bytes``),
        # or (a door's) the store does not take what it forwards
        self.held = False
        self.events = 0        # what the selector watches it for (``KVServer._watch``)
        self.authed = False
        self.nonce = os.urandom(NONCE_BYTES)
        # its plain requests' stream (None), and each of its ``MUXED`` streams by id
        self.streams: dict[int | None, _Stream] = {}
        self.closed = False


class _Stream:
    """Requests served in order: a connection's plain ones, or one stream of a multiplexed
    connection (``kvstore.MUXED``)."""

    __slots__ = ("conn", "sid", "waiting", "queue")

    def __init__(self, conn: _Conn, sid: int | None):
        self.conn, self.sid = conn, sid
        self.waiting: _Wait | None = None     # a get/wait blocked on keys not yet there
        self.queue: collections.deque | None = None   # requests that came behind it


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
        # an appended value is a bytearray, grown in place; every answer copies what it sends
        self._data: dict[bytes, bytes | bytearray] = {}
        self._waiters: dict[bytes, set[_Stream]] = collections.defaultdict(set)
        # (when, tie-break, a connection's handshake or a stream's wait, "handshake" or the
        # _Wait)
        self._deadlines: list[tuple[float, int, object, object]] = []
        self._seq = 0
        self._pending: collections.OrderedDict[_Conn, float] = collections.OrderedDict()
        self._conns: set[_Conn] = set()       # accepted, open (a held one is not watched)
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._stopping = False
        self._rview = memoryview(bytearray(READ_BYTES))    # ``read_some``
        self.requests = 0          # requests served (the agent reports the count)
        self.refused = 0           # connections closed before or at the handshake
        self._setup()
        self._thread = threading.Thread(target=self._serve, name="kvstore", daemon=True)
        self._thread.start()

    @classmethod
    def listen(cls, key: bytes, host: str = "127.0.0.1", port: int = 0,
               limits: StoreLimits = StoreLimits(), backlog: int = 1024) -> "KVServer":
        return cls(key, socket.create_server((host, port), backlog=backlog), limits)

    @property
    def port(self) -> int:
        return self._listener.getsockname()[1]

    def serving(self) -> bool:
        """Whether its thread still serves (an error in it closes every connection)."""
        return self._thread.is_alive()

    def connections(self) -> int:
        """Connections open now that proved the key (read from another thread: a count
        that may be a moment old)."""
        return sum(1 for conn in list(self._conns) if conn.authed)

    def close(self) -> None:
        self._stopping = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(timeout=5)

    def _setup(self) -> None:
        """Before the loop starts (a subclass registers its own sockets)."""

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
            socks = [conn.sock for conn in self._conns] + \
                [key.fileobj for key in self._sel.get_map().values()]
            for sock in socks:
                try:
                    sock.close()
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
            self._conns.add(conn)
            self._watch(conn)
            deadline = time.monotonic() + self._limits.handshake_timeout_s
            self._pending[conn] = deadline
            self._at(deadline, conn, "handshake")
            while len(self._pending) > self._limits.max_pending:
                self._close(next(iter(self._pending)))
            self._send(conn, MAGIC + conn.nonce)

    def _at(self, deadline: float, whose, what) -> None:
        self._seq += 1
        heapq.heappush(self._deadlines, (deadline, self._seq, whose, what))

    def _expire(self, now: float) -> None:
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, whose, what = heapq.heappop(self._deadlines)
            if what == "handshake":
                if not whose.closed and not whose.authed:
                    self._close(whose)
            elif not whose.conn.closed and whose.waiting is what:
                self._unwait(whose)
                self._answer(whose, encode_answer(Status.TIMEOUT))
                self._drain(whose)

    def _close(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        if not conn.authed:
            self.refused += 1
        self._pending.pop(conn, None)
        for stream in conn.streams.values():
            if stream.waiting is not None:
                self._unwait(stream)
        self._conns.discard(conn)
        if conn.events:
            conn.events = 0
            self._sel.unregister(conn.sock)
        conn.sock.close()

    def read_some(self, conn: _Conn) -> int | None:
        """What the socket holds (up to ``READ_BYTES``) onto ``conn``'s buffer: how many
        bytes, 0 where the peer closed, None where nothing was there; an error raises."""
        try:
            n = conn.sock.recv_into(self._rview)
        except (BlockingIOError, InterruptedError):
            return None
        conn.inbuf += self._rview[:n]
        return n

    def _read(self, conn: _Conn) -> None:
        try:
            n = self.read_some(conn)
        except OSError:
            n = 0
        if n is None:
            return
        if not n:
            self._close(conn)
            return
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
        conn.streams[None] = _Stream(conn, None)
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
        conn.outbuf += data
        self._watch(conn)

    def _flush(self, conn: _Conn) -> None:
        try:
            sent = conn.sock.send(conn.outbuf)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        del conn.outbuf[:sent]
        held = conn.held
        self._watch(conn)
        if held and not conn.held and conn.inbuf:
            self._process(conn)        # what it sent while held

    def _watch(self, conn: _Conn) -> None:
        """The selector watches ``conn`` for what it needs: written to while answers wait,
        read unless held. A connection that does not take its answers is held once more
        than ``max_unsent_bytes`` wait, until they are taken: its requests already read
        wait in its buffer (``_frames`` takes none while it is held), what it sends
        meanwhile stays in the kernel's buffers and then its own, not in this process's
        memory."""
        if conn.closed:
            return
        conn.held = self._hold(conn)
        events = (0 if conn.held else selectors.EVENT_READ) | \
            (selectors.EVENT_WRITE if conn.outbuf else 0)
        if events == conn.events:
            return
        if not conn.events:
            self._sel.register(conn.sock, events, conn)
        elif not events:
            self._sel.unregister(conn.sock)
        else:
            self._sel.modify(conn.sock, events, conn)
        conn.events = events

    def _hold(self, conn: _Conn) -> bool:
        """Whether ``conn`` is not to be read now: past the bound, until its answers are
        all taken."""
        return len(conn.outbuf) > self._limits.max_unsent_bytes or \
            (conn.held and bool(conn.outbuf))

    def _frames(self, conn: _Conn):
        """The whole requests in ``conn``'s buffer, taken out of it one by one (while the
        connection stays open); a frame past the limits closes it."""
        buf = conn.inbuf
        while not conn.closed and not conn.held and len(buf) >= 4:
            (size,) = FRAME.unpack_from(buf, 0)
            if size > self._limits.max_frame_bytes or size < REQUEST.size:
                self._close(conn)
                return
            if len(buf) < 4 + size:
                return
            body = bytes(buf[4:4 + size])
            del buf[:4 + size]
            yield body

    def _process(self, conn: _Conn) -> None:
        """Take the whole requests in ``conn``'s buffer, each to its stream."""
        for body in self._frames(conn):
            sid = None
            if body[0] & MUXED:
                if len(body) < REQUEST.size + STREAM.size:
                    self._close(conn)
                    return
                (sid,) = STREAM.unpack_from(body, REQUEST.size)
                body = bytes([body[0] & ~MUXED]) + body[1:REQUEST.size] + \
                    body[REQUEST.size + STREAM.size:]
            stream = conn.streams.get(sid)
            if stream is None:
                if len(conn.streams) > self._limits.max_streams:
                    self._send(conn, tag_answer(encode_answer(Status.STREAM_CLOSED), sid))
                    continue
                stream = conn.streams[sid] = _Stream(conn, sid)
            if sid is not None and body[0] & ~NO_REPLY == Op.END_STREAM:
                self._end(stream)
            elif stream.waiting is not None or stream.queue:
                if stream.queue is None:
                    stream.queue = collections.deque()
                stream.queue.append(body)
            else:
                self._run(stream, body)

    def _drain(self, stream: _Stream) -> None:
        """Serve what came on ``stream`` behind a request just answered, up to the next one
        that blocks."""
        queue = stream.queue
        while queue and stream.waiting is None and not stream.conn.closed:
            self._run(stream, queue.popleft())

    def _end(self, stream: _Stream) -> None:
        """A stream's client is gone (the agent's forwarded connection closed)."""
        if stream.waiting is not None:
            self._unwait(stream)
        stream.queue = None
        stream.conn.streams.pop(stream.sid, None)

    def _answer(self, stream: _Stream, answer: bytes) -> None:
        self._send(stream.conn, answer if stream.sid is None else
                   tag_answer(answer, stream.sid))

    def _run(self, stream: _Stream, raw: bytes) -> None:
        """Serve one request of ``stream``."""
        body = memoryview(raw)
        quiet = False
        try:
            op, timeout_ms, number, count = REQUEST.unpack_from(body, 0)
            quiet = bool(op & NO_REPLY)
            op = Op(op & ~NO_REPLY)
            if quiet and op not in NO_REPLY_OPS:
                raise ValueError(f"{op.name} always answers")
            if op == Op.END_STREAM:
                raise ValueError("END_STREAM ends a stream of a multiplexed connection")
            fields = parse_fields(body, REQUEST.size, count)
            answer = self._handle(stream, op, timeout_ms, number, fields)
        except (ValueError, struct.error) as exc:
            if quiet:          # nobody to tell: the writer learns at its next request
                if stream.sid is None:
                    self._close(stream.conn)
                else:          # the other streams of the connection are not its
                    self._end(stream)
                    self._answer(stream, encode_answer(Status.STREAM_CLOSED))
                return
            answer = encode_answer(Status.ERROR, 0, [str(exc).encode()])
        self.requests += 1
        if answer is not None and not quiet:
            self._answer(stream, answer)

    def _handle(self, stream: _Stream, op: Op, timeout_ms: int, number: int,
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
                stream.waiting = wait
                for k in missing:
                    self._waiters[k].add(stream)
                self._at(wait.deadline, stream, wait)
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
            # one key or several (``KVClient.delete_keys``): how many were there
            if not fields:
                raise ValueError("delete needs a key")
            return encode_answer(Status.OK, sum(data.pop(k, None) is not None
                                                for k in fields))
        elif op == Op.NUM_KEYS:
            return encode_answer(Status.OK, len(data))
        elif op == Op.APPEND:
            key, value = _exactly(fields, 2)
            old = data.get(key)
            if type(old) is bytearray:
                # in place: a step's ballots are one append a host, and copying the value
                # at each was O(hosts^2) bytes a step (12,500 hosts: ~10 GB)
                old += value
            else:
                data[key] = bytearray(old or b"") + value
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
        streams = self._waiters.pop(key, None)
        if not streams:
            return
        for stream in streams:
            wait = stream.waiting
            if wait is None or stream.conn.closed:
                continue
            missing = [k for k in wait.keys if k not in self._data]
            if missing:       # still waiting (for a key deleted since, too)
                for k in missing:
                    self._waiters[k].add(stream)
                continue
            self._unwait(stream)
            self._answer(stream, self._ready(wait.op, wait.keys))
            self._drain(stream)

    def _unwait(self, stream: _Stream) -> None:
        wait, stream.waiting = stream.waiting, None
        for k in wait.keys:
            waiters = self._waiters.get(k)
            if waiters is not None:
                waiters.discard(stream)
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
