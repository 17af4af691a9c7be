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
    server -> client   HMAC(key, "server" Ns Nc), or ``REFUSED`` for a wrong proof

A connection that has not completed it within ``handshake_timeout_s`` is closed, and only
``max_pending`` of them are kept (the oldest goes first): unauthenticated peers cost a few
file descriptors, never the server's attention. A client whose connection is closed
before it was answered (the oldest pending one in a burst of thousands of workers
connecting at once) connects again until its connect timeout; one answered ``REFUSED``
does not. The key is per run (derived from the
secret and the run id), so nothing from another run or resume of the job gets in. What it
does not do: encrypt, or authenticate each message after the handshake. On one host only
root can read or inject loopback traffic; across hosts the job's network is trusted as
gloo's and NCCL's own traffic is (see the security docs).

After the handshake each request is one frame (a 4-byte length, then the body) and gets one
answer frame, in order. Semantics follow torch's ``Store``: ``get`` and ``wait`` block
until the keys exist or the request's timeout passes (waiting in the server, so a client
waits with one request instead of polling), ``add`` counts in decimal text,
``compare_set`` sets a missing key only when the expected value is empty. ``set``
answers once the value is there, so what any client reads after it returns sees it (where
TCPStore's returns at once); ``append`` answers nothing, the writer going on at once (what
it sends next on the connection is answered after it: a voter's ballot is in before its
vote counts). Unlike
TCPStore, ``add`` on a value that is not an integer answers an error and keeps the
connection. One thread serves every connection (``core/kvserver.py``: the protocol's work
per request is a dict operation; the thread never blocks on a client).

This module holds the protocol and the client. Pure Python, no torch: ``comm/store.py``
adapts the client to ``torch.distributed.Store`` for the backends' own rendezvous."""
from __future__ import annotations

import errno
import hashlib
import hmac
import os
import re
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
# The server's answer to a wrong proof: no HMAC is all zeros (but by a 2^-256 chance), so a
# client tells "refused" from a connection dropped before it was answered, which it retries.
REFUSED = bytes(MAC_BYTES)
FRAME = struct.Struct(">I")
# a request: op, timeout (ms), a number (add's delta), the count of byte-string fields
REQUEST = struct.Struct(">BIqI")
# an answer: status, a number (add's result, a count, a flag), the count of fields
ANSWER = struct.Struct(">BqI")
FIELD = struct.Struct(">I")


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
    TRY_MULTI_GET = 15   # TRY_GET of several keys in one request
    END_STREAM = 16      # a stream of a multiplexed connection is done (``MUXED``)


# A writing request with this bit set in its op gets no answer: the writer goes on at once,
# and its later requests on the connection are answered after it. Another connection may
# be served first, so only a write whose readers learn of it through the same writer's
# later requests (a ballot, then the vote counter) may go without an answer.
NO_REPLY = 0x80
NO_REPLY_OPS = (Op.SET, Op.APPEND, Op.MULTI_SET, Op.END_STREAM)

# A request with this bit set in its op carries a stream id (``STREAM``, after the request's
# header) and its answer the same id (the bit set in its status, the id after the answer's
# header). Each stream of a connection is served as a connection of its own: in order, a
# blocked get or wait holding that stream's later requests only. A host's agent forwards
# every local process's connection to the store as one stream of its one connection
# (``core/kvproxy.py``): the store holds a connection a host, not a few a process.
MUXED = 0x40
STREAM = struct.Struct(">I")


# Keys a delete request names at most (``KVClient.delete_keys``): a recovery's end at 16K
# workers deleted ~33K keys (each worker's report and note keys) one request each, 0.5 s of
# the controller's round at 4K workers and as many requests of the store's one thread.
DELETE_BATCH = 1024


class Status(IntEnum):
    OK = 0
    TIMEOUT = 1
    ERROR = 2
    NOT_A_NUMBER = 3     # ``add`` on a value that is no integer
    # a stream of a multiplexed connection was ended by the server (a write that answers
    # nothing was refused, or the connection has too many streams): where a plain
    # connection would be closed, its forwarder closes the connection it forwards
    STREAM_CLOSED = 4


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


def handshake_mac(key: bytes, who: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(key, who + server_nonce + client_nonce, hashlib.sha256).digest()


@dataclass(frozen=True)
class StoreLimits:
    """What one connection may ask of the server. The defaults fit the job's largest value
    (the controller's snapshot, a gloo rendezvous list at thousands of ranks) with room."""
    handshake_timeout_s: float = 10.0      # an unauthenticated connection is closed after it
    max_pending: int = 64                  # unauthenticated connections kept (oldest closed)
    max_frame_bytes: int = 1 << 30         # a longer request closes its connection
    max_key_bytes: int = 4096
    max_streams: int = 1 << 16             # streams of one multiplexed connection
    # a connection that does not take its answers is not read while more than this waits
    # to be sent to it (its requests stay in its own buffers, not the server's memory)
    max_unsent_bytes: int = 64 << 20

    @staticmethod
    def of(comm) -> "StoreLimits":
        """The limits a job's ``CommConfig`` sets."""
        return StoreLimits(handshake_timeout_s=comm.store_handshake_timeout_s,
                           max_pending=comm.store_max_pending)


def encode_request(op: Op, fields=(), number: int = 0, timeout_ms: int = 0) -> bytes:
    body = [REQUEST.pack(op, timeout_ms, number, len(fields))]
    for f in fields:
        body.append(FIELD.pack(len(f)))
        body.append(f)
    payload = b"".join(body)
    return FRAME.pack(len(payload)) + payload


def encode_answer(status: Status, number: int = 0, fields=()) -> bytes:
    body = [ANSWER.pack(status, number, len(fields))]
    for f in fields:
        body.append(FIELD.pack(len(f)))
        body.append(f)
    payload = b"".join(body)
    return FRAME.pack(len(payload)) + payload


def tag_request(body: bytes | memoryview, stream: int) -> bytes:
    """A framed request of stream ``stream`` from a plain request's body (no frame)."""
    if body[0] & MUXED:
        raise ValueError("the request is already a stream's")
    head = REQUEST.size
    tagged = bytes([body[0] | MUXED]) + bytes(body[1:head]) + STREAM.pack(stream) + \
        bytes(body[head:])
    return FRAME.pack(len(tagged)) + tagged


def untag_answer(body: bytes | memoryview) -> tuple[int, bytes]:
    """``(stream, the plain framed answer)`` of a stream's answer body (no frame)."""
    head = ANSWER.size
    if not body[0] & MUXED or len(body) < head + STREAM.size:
        raise ValueError("not a stream's answer")
    (stream,) = STREAM.unpack_from(body, head)
    plain = bytes([body[0] & ~MUXED]) + bytes(body[1:head]) + bytes(body[head + STREAM.size:])
    return stream, FRAME.pack(len(plain)) + plain


def tag_answer(answer: bytes, stream: int) -> bytes:
    """A framed answer (``encode_answer``) as stream ``stream``'s."""
    head = 4 + ANSWER.size
    tagged = bytes([answer[4] | MUXED]) + answer[5:head] + STREAM.pack(stream) + answer[head:]
    return FRAME.pack(len(tagged)) + tagged


def parse_fields(body: memoryview, offset: int, count: int) -> list[bytes]:
    out = []
    for _ in range(count):
        if offset + 4 > len(body):
            raise ValueError("truncated field")
        (n,) = FIELD.unpack_from(body, offset)
        offset += 4
        if offset + n > len(body):
            raise ValueError("truncated field")
        out.append(bytes(body[offset:offset + n]))
        offset += n
    if offset != len(body):
        raise ValueError("trailing bytes")
    return out


def decode_answer(body: bytes) -> tuple[Status, int, list[bytes]]:
    status, number, count = ANSWER.unpack_from(body, 0)
    return Status(status), number, parse_fields(memoryview(body), ANSWER.size, count)


_COUNT = re.compile(rb"-?[0-9]{1,19}")


def is_count(value: bytes) -> bool:
    """Whether ``value`` is a counter's value: decimal digits, optionally negative (or empty,
    which counts as 0, as torch's stores count it)."""
    return not value or _COUNT.fullmatch(value) is not None


def as_int(value: bytes) -> int | None:
    """A counter's value, or None where torch's ``stoll`` would have read a prefix of it."""
    return (int(value) if value else 0) if is_count(value) else None


# --- client -------------------------------------------------------------------------------

class KVClient:
    """One connection to the store. Thread-safe: requests are answered in order, so a
    thread's blocking ``get`` holds the others' requests behind it (give each thread its own
    client, as ``comm.groups.StoreClients`` does)."""

    def __init__(self, host: str, port: int, key: bytes, timeout_s: float,
                 connect_timeout_s: float | None = None):
        self.host, self.port = host, port
        self.timeout_s = timeout_s
        # how much later than the request's own timeout the socket gives up: a server
        # answers a wait at its timeout, a margin before (0: the timeout is the bound)
        self.answer_margin_s = 5.0
        self._lock = threading.Lock()
        self._sock = connect_socket(host, port, key, timeout_s if connect_timeout_s is None
                                    else connect_timeout_s)

    @property
    def timeout(self) -> timedelta:
        """How long a blocking request waits (as a torch store's ``timeout``)."""
        return timedelta(seconds=self.timeout_s)

    def close(self) -> None:
        self._sock.close()

    def abort(self) -> None:
        """Close the connection from another thread: a request blocked on it raises
        ``StoreClosed`` at once (a ``close`` alone leaves a blocked read waiting)."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass                     # not connected any more
        self._sock.close()

    def _call(self, op: Op, fields=(), number: int = 0, wait_s: float | None = None,
              before: bytes = b"") -> tuple[int, list[bytes]]:
        """One request and its answer; ``before``: requests that answer nothing
        (``NO_REPLY``), sent in the same write ahead of it."""
        timeout_ms = 0 if wait_s is None else max(0, int(wait_s * 1000))
        request = before + encode_request(op, fields, number, timeout_ms)
        with self._lock:
            try:
                # the server answers a wait at its timeout: the socket's is a margin later
                self._sock.settimeout(self.timeout_s + (wait_s or 0) + self.answer_margin_s)
                self._sock.sendall(request)
                (size,) = FRAME.unpack(_recv_exactly(self._sock, 4))
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
        self._call(Op.SET, [_b(key), _b(value)])

    def try_get(self, key: str) -> bytes | None:
        """The key's value, or None if it has none (one round trip, no wait)."""
        found, out = self._call(Op.TRY_GET, [_b(key)])
        return out[0] if found else None

    def try_multi_get(self, keys: list[str]) -> list[bytes | None]:
        """Each key's value, or None where it has none: one round trip, no wait (the
        controller reads every host's heartbeat so)."""
        if not keys:
            return []
        _, out = self._call(Op.TRY_MULTI_GET, [_b(k) for k in keys])
        if len(out) != len(keys):
            raise StoreError(f"try_multi_get: {len(out)} answers for {len(keys)} keys")
        return [v[1:] if v[:1] == b"\x01" else None for v in out]

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

    def delete_keys(self, keys: list[str]) -> int:
        """Delete ``keys`` (those there), ``DELETE_BATCH`` a request: how many were there."""
        return sum(self._call(Op.DELETE, [_b(k) for k in keys[i:i + DELETE_BATCH]])[0]
                   for i in range(0, len(keys), DELETE_BATCH))

    def num_keys(self) -> int:
        return self._call(Op.NUM_KEYS)[0]

    def append(self, key: str, value: bytes | str) -> None:
        self._tell(Op.APPEND, [_b(key), _b(value)])

    def append_then_add(self, key: str, value: bytes | str, counter: str, delta: int) -> int:
        """``append(key, value)``, then ``add(counter, delta)``'s count, in one write: a
        step's ballot and its count, from every host on every step, reach the store's one
        thread as one read instead of two. A counter holding no number raises
        ``StoreNotANumber`` after the append was made."""
        return self._call(Op.ADD, [_b(counter)], number=int(delta),
                          before=encode_request(Op.APPEND | NO_REPLY, [_b(key), _b(value)]))[0]

    def multi_get(self, keys: list[str], timeout: float | timedelta | None = None
                  ) -> list[bytes]:
        return self._call(Op.MULTI_GET, [_b(k) for k in keys], wait_s=self._wait(timeout))[1]

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        if len(keys) != len(values):
            raise ValueError(f"multi_set: {len(keys)} keys but {len(values)} values")
        self._call(Op.MULTI_SET, [_b(x) for kv in zip(keys, values) for x in kv])

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


def connect_socket(host: str, port: int, key: bytes, timeout_s: float) -> socket.socket:
    """A connection to the store that proved the key both ways, retrying until ``timeout_s``
    a connection refused (the server may not listen yet: TCPStore's clients wait for it the
    same way) or dropped before the handshake was answered (the server keeps
    ``max_pending`` unauthenticated connections: in a burst of thousands, the oldest are
    closed). A store that answers ``REFUSED``, or a proof of another key, is not retried;
    nor is this process out of descriptors (it is no store's to end: said at once, not
    after the timeout as a store that cannot be reached)."""
    deadline = time.monotonic() + timeout_s
    delay = 0.01
    while True:
        try:
            return _handshake(host, port, key, deadline)
        except StoreRefused:
            raise
        except (StoreClosed, OSError) as exc:
            if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):
                raise StoreClosed(f"cannot connect to the store at {host}:{port}: this "
                                  f"process is out of descriptors ({exc})") from exc
            if time.monotonic() + delay > deadline:
                raise StoreClosed(f"cannot connect to the store at {host}:{port}"
                                  f" within {timeout_s} s: {exc}") from exc
            time.sleep(delay)
            delay = min(delay * 2, 0.5)


def _handshake(host: str, port: int, key: bytes, deadline: float) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic()))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        hello = _recv_exactly(sock, len(MAGIC) + NONCE_BYTES)
        if hello[:len(MAGIC)] != MAGIC:
            raise StoreRefused(f"{host}:{port} is not a trainmover store")
        server_nonce, client_nonce = hello[len(MAGIC):], os.urandom(NONCE_BYTES)
        sock.sendall(client_nonce + handshake_mac(key, b"client", server_nonce, client_nonce))
        proof = _recv_exactly(sock, MAC_BYTES)
        if proof == REFUSED:
            raise StoreRefused(f"the store at {host}:{port} refused this client "
                               f"(not this run's key)")
        if not hmac.compare_digest(proof, handshake_mac(key, b"server", server_nonce,
                                                        client_nonce)):
            raise StoreRefused(f"the store at {host}:{port} does not hold this run's key")
    except BaseException:
        sock.close()
        raise
    return sock


def _b(x: bytes | str) -> bytes:
    return x.encode() if isinstance(x, str) else bytes(x)


# Past this many bytes an answer is read into a buffer of its size: a ``recv(n)`` allocates
# n bytes at every call, each getting what one read brings (a step's ballots at 12,500 hosts,
# 1.7 MB, came in ~30 reads of ~64 KB, each allocating up to 1.7 MB).
RECV_INTO_BYTES = 1 << 16


def _recv_exactly(sock: socket.socket, n: int) -> bytes | bytearray:
    if n > RECV_INTO_BYTES:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = sock.recv_into(view[got:], n - got)
            if not k:
                raise StoreClosed("connection closed by the store")
            got += k
        return buf
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise StoreClosed("connection closed by the store")
        out += chunk
    return bytes(out)


def connect(host: str, port: int, run_key: bytes, timeout_s: float,
            connect_timeout_s: float | None = None) -> KVClient:
    """A client of the store of the run ``run_key`` belongs to (torch-free: the controller
    and the CLI; torch's backends get ``comm.store.KVStore``)."""
    return KVClient(host, port, store_key(run_key), timeout_s, connect_timeout_s)
