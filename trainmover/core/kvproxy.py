"""A host's door to the job's store: the agent serves its processes the store's protocol on a
loopback port, and forwards every connection made to it as one stream of its own single
connection to the store (``kvstore.MUXED``).

Why: every worker held a connection of its own to the job's one store, and each of its
threads that blocks on the store one more, beside the agent's own: about two hundred
thousand connections at 100K GPUs, each a descriptor and buffers in the store's process
and a handshake in the start-up burst. Through the door the store holds one connection a
host for the workers, whatever their number and threads.

What it keeps: a process's requests are answered in order and a blocked get or wait holds
only that process's connection (the store serves each stream as a connection of its own);
a process proves the run's key to the door as it would to the store (the door's port is in
``ps`` too, and answers no one else); the door proves it back, holding the same key. It
reads only the frames' lengths and the op byte: values pass through untouched and are
checked where they are read (``core/auth.py``). When the door's connection to the store is
lost, every connection made to the door is closed, as the store's own would be.
"""
from __future__ import annotations

import socket

from trainmover.core.kvserver import KVServer, _Conn
from trainmover.core.kvstore import (FRAME, MUXED, NO_REPLY, Op, Status, StoreLimits,
                                     connect_socket, encode_answer, encode_request, store_key,
                                     tag_request, untag_answer)

PONG = encode_answer(Status.OK)


class KVProxy(KVServer):
    """Serves the store's protocol on ``sock`` from one thread, forwarding to ``upstream`` (a
    connection to the store that completed the handshake)."""

    def __init__(self, key: bytes, sock: socket.socket, upstream: socket.socket,
                 limits: StoreLimits = StoreLimits()):
        # the store's connection, sent to and watched as a process's is (``_send``,
        # ``_watch``); read by ``_up_read``
        self._up = _Conn(upstream)
        self._conn_of: dict[int, _Conn] = {}      # stream id -> the connection it forwards
        self._sid_of: dict[_Conn, int] = {}
        # a connection's requests forwarded and not yet answered (those that answer)
        self._unanswered: dict[_Conn, int] = {}
        self._next_sid = 0
        self.upstream_error: str | None = None     # why the store's connection was lost
        self.forwarded = 0                         # requests forwarded
        self.pinged = 0                            # pings answered here
        super().__init__(key, sock, limits)

    def _setup(self) -> None:
        self._up.sock.setblocking(False)
        self._watch(self._up)

    # -- downstream: the host's processes -------------------------------------------------

    def _process(self, conn: _Conn) -> None:
        """Forward the whole requests in ``conn``'s buffer as its stream's."""
        if self.upstream_error is not None:
            self._close(conn)
            return
        for body in self._frames(conn):
            op = body[0]
            if op & MUXED:
                self._close(conn)        # a stream of a stream is nothing the job sends
                return
            if op == Op.PING and not self._unanswered.get(conn):
                # answered here: the door closes every connection once it loses the store,
                # so an open one is as much of an answer, and a process that waits (for a
                # recovery's plan, a command) checks its store every second: that is the
                # job's size in requests a second at the store, which stay on the host.
                # Counted before the answer goes: a reader of the count who has the answer
                # finds it counted (a test once read it in between)
                self.pinged += 1
                self._send(conn, PONG)
                continue
            sid = self._sid_of.get(conn)
            if sid is None:
                sid = self._new_stream(conn)
            self.forwarded += 1
            self._send(self._up, tag_request(body, sid))
            if not op & NO_REPLY:
                self._unanswered[conn] = self._unanswered.get(conn, 0) + 1
            if len(self._up.outbuf) > self._limits.max_unsent_bytes:
                self._watch(conn)            # held: the rest waits in its buffer

    def _new_stream(self, conn: _Conn) -> int:
        self._next_sid = (self._next_sid + 1) & 0xFFFFFFFF
        while self._next_sid in self._conn_of:      # after 2^32 connections
            self._next_sid = (self._next_sid + 1) & 0xFFFFFFFF
        self._conn_of[self._next_sid] = conn
        self._sid_of[conn] = self._next_sid
        return self._next_sid

    def _hold(self, conn: _Conn) -> bool:
        """A process's connection is not read while the store does not take what was
        forwarded (more than ``max_unsent_bytes`` waiting): the door's memory stays bounded
        whatever its processes send. The store's connection itself is always read."""
        if conn is self._up:
            return False
        return len(self._up.outbuf) > self._limits.max_unsent_bytes or super()._hold(conn)

    def _flush(self, conn: _Conn) -> None:
        held = conn is self._up and len(conn.outbuf) > self._limits.max_unsent_bytes
        super()._flush(conn)
        if held and len(conn.outbuf) <= self._limits.max_unsent_bytes:
            for other in list(self._conns):      # the store takes again: read them again
                if other.held:
                    self._watch(other)
                    if not other.held and other.inbuf:
                        self._process(other)

    def _read(self, conn: _Conn) -> None:
        if conn is self._up:
            self._up_read()
        elif self._hold(conn):
            self._watch(conn)                # the store takes nothing now: not read
        else:
            super()._read(conn)

    def _close(self, conn: _Conn) -> None:
        if conn is self._up:
            self._lost("sending to the store failed")
            return
        self._unanswered.pop(conn, None)
        sid = self._sid_of.pop(conn, None)
        if sid is not None:
            self._conn_of.pop(sid, None)
            if self.upstream_error is None:
                # its waits in the store end with it
                self._send(self._up, tag_request(memoryview(
                    encode_request(Op.END_STREAM | NO_REPLY))[4:], sid))
        super()._close(conn)

    # -- upstream: the store ----------------------------------------------------------------

    def _up_read(self) -> None:
        try:
            n = self.read_some(self._up)
        except OSError as exc:
            return self._lost(f"{exc}")
        if n is None:
            return
        if not n:
            return self._lost("the store closed the connection")
        buf = self._up.inbuf
        while len(buf) >= 4:
            (size,) = FRAME.unpack_from(buf, 0)
            if len(buf) < 4 + size:
                return
            try:
                with memoryview(buf) as view:
                    sid, answer = untag_answer(view[4:4 + size])
            except ValueError as exc:
                return self._lost(f"an answer that is no stream's: {exc}")
            del buf[:4 + size]
            conn = self._conn_of.get(sid)
            if conn is None:              # its connection closed meanwhile
                continue
            if answer[4] == Status.STREAM_CLOSED:
                # the store ended the stream where it would have closed a connection
                self._sid_of.pop(conn, None)
                self._conn_of.pop(sid, None)
                self._close(conn)
            else:
                left = self._unanswered.get(conn, 0) - 1
                if left > 0:
                    self._unanswered[conn] = left
                else:
                    self._unanswered.pop(conn, None)
                self._send(conn, answer)

    def _lost(self, why: str) -> None:
        """The store's connection is gone: so is every connection made here."""
        if self.upstream_error is not None:
            return
        self.upstream_error = why
        up = self._up
        up.closed = True
        if up.events:
            up.events = 0
            self._sel.unregister(up.sock)
        up.sock.close()
        for conn in list(self._conns):
            self._close(conn)


def serve(run_key: bytes, store_host: str, store_port: int, connect_timeout_s: float,
          host: str = "127.0.0.1", limits: StoreLimits = StoreLimits()) -> KVProxy:
    """A door to the store at ``store_host:store_port`` of the run ``run_key`` belongs to,
    served from a thread of this process on a free port of ``host``."""
    key = store_key(run_key)
    upstream = connect_socket(store_host, store_port, key, connect_timeout_s)
    return KVProxy(key, socket.create_server((host, 0), backlog=1024), upstream, limits)
