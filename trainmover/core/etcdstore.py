"""The job's store on an etcd cluster: control state that outlives any one host.

Why: the default store (``core/kvserver.py``) is one thread of host 0's agent. Losing that
host loses every key the job's processes coordinate through, and the job with them. etcd
keeps the same keys on a Raft-replicated cluster (three members on three hosts survive the
loss of any one), so the store outlives any host; the rest of the job (the controller, the
lost host's roles) is rebuilt from it as after any other failure.

This is a client of etcd's JSON gateway (``/v3/...``, etcd 3.4 and later) with the
methods and semantics of ``core/kvstore.KVClient``, so everything above the store (signed
values, votes, the backends' rendezvous) is unchanged. Why a client of our own and not a
library: every waiting request needs a deadline in the caller's thread, every request must
move to another member when its member goes (a request is retried there until
``failover_s``), and ``add``/``append`` must stay exact across that retry (below); the
maintained Python clients give neither the deadline nor the failover, and each watch there
runs a thread. The gateway's protocol is six JSON calls on the standard library's HTTP.

Semantics, as ``KVClient``'s: ``get``/``wait``/``multi_get`` block until the keys exist
(a watch from the revision at which they were missing, so nothing set in between is
missed) or the timeout passes (``StoreTimeout``); ``add`` counts in decimal text
(``StoreNotANumber`` otherwise); ``compare_set`` sets a missing key only when the expected
value is empty; ``set`` answers once the write is committed by a majority.

Exactly once: a write whose answer is lost (its member died after the leader took it)
cannot be told from one that was never made, so it is retried on another member. ``set``,
``multi_set``, ``delete_key`` and ``compare_set`` give the same result when repeated;
``add`` and ``append`` would count twice. Each of those is a transaction conditional on
the key's revision that also writes a marker key named by a per-client request id (kept
``MARKER_TTL_S`` on a lease): a retry first reads the marker, and finds the first try's
result there if it went through.

Security: the cluster must require client certificates (``--client-cert-auth``, and
``--peer-client-cert-auth`` between members): a local user without the job's client key
can then neither read nor write. The values are sealed as on the default store
(``core/auth.py``); keys live under a prefix derived from the run's key, so runs sharing a
cluster never see each other's keys."""
from __future__ import annotations

import base64
import hashlib
import http.client
import itertools
import json
import os
import random
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

from trainmover.core.kvstore import (StoreClosed, StoreError, StoreNotANumber, StoreRefused,
                                     StoreTimeout, as_int)

# etcd's default limit on the operations of one transaction (``--max-txn-ops``).
TXN_OPS = 128
# How long an ``add``'s or ``append``'s marker is kept: far longer than any retry of it.
MARKER_TTL_S = 600
# A member that answered with an error a client should take elsewhere (gRPC Unavailable:
# no leader, leader changed, request timed out while the cluster elects).
_UNAVAILABLE = 14
# How long one try of a request may take before it is retried on the next member. etcd
# itself answers a write that was in flight when its leader died only at its own request
# timeout (5 s plus two election timeouts): every agent's heartbeat once stalled that long
# and the new controller declared every host lost.
ATTEMPT_S = 1.0
# How long one watch is trusted before the keys are read again: a member cut off from the
# others keeps a watch open but sees no new writes (the read goes through the leader).
WATCH_RECHECK_S = 5.0


@dataclass(frozen=True)
class EtcdTLS:
    """The files of the job's client certificate and the cluster's certificate authority."""
    ca: str
    cert: str | None
    key: str | None

    def context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.ca)
        if self.cert:
            ctx.load_cert_chain(self.cert, self.key)
        return ctx


def run_prefix(store_key: bytes) -> bytes:
    """The prefix of a run's keys: from its store key, so runs on one cluster are apart."""
    return b"/trainmover/" + hashlib.sha256(b"etcd-prefix" + store_key).hexdigest()[:32].encode()


def _b64(x: bytes) -> str:
    return base64.b64encode(x).decode()


def _unb64(s: str | None) -> bytes:
    return base64.b64decode(s) if s else b""


def _range_end(prefix: bytes) -> bytes:
    """The end of the key range that holds every key starting with ``prefix``."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


class _Unavailable(Exception):
    """This member cannot answer now: try another."""


class _Member:
    """One keep-alive HTTP(S) connection to one member's gateway."""

    def __init__(self, host: str, port: int, tls: ssl.SSLContext | None):
        self.host, self.port, self.tls = host, port, tls
        self.conn: http.client.HTTPConnection | None = None

    def open(self, timeout: float) -> http.client.HTTPConnection:
        if self.tls is not None:
            return http.client.HTTPSConnection(self.host, self.port, timeout=timeout,
                                               context=self.tls)
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def post(self, path: str, body: dict, timeout: float) -> dict:
        """One request; ``_Unavailable`` when the member cannot answer it (gone, or no
        leader), ``StoreError`` when it answers an error that another member would too."""
        data = json.dumps(body).encode()
        try:
            if self.conn is None:
                self.conn = self.open(timeout)
            self.conn.timeout = timeout
            if self.conn.sock is not None:
                self.conn.sock.settimeout(timeout)
            self.conn.request("POST", path, data, {"Content-Type": "application/json"})
            resp = self.conn.getresponse()
            raw = resp.read()
        except ssl.SSLError as exc:
            self.close()
            # a member the job's authority did not certify, or one that refused this
            # client's certificate (a TLS alert): not a member to wait for
            if isinstance(exc, ssl.SSLCertVerificationError) or "ALERT" in str(exc).upper():
                raise StoreRefused(f"etcd member {self.host}:{self.port}: {exc}") from exc
            raise _Unavailable(f"{self.host}:{self.port}: {exc}") from exc
        except (OSError, http.client.HTTPException) as exc:
            self.close()
            raise _Unavailable(f"{self.host}:{self.port}: {exc}") from exc
        try:
            out = json.loads(raw) if raw else {}
        except ValueError as exc:
            self.close()
            raise _Unavailable(f"{self.host}:{self.port}: not JSON ({raw[:100]!r})") from exc
        if resp.status != 200:
            code = out.get("code") if isinstance(out, dict) else None
            message = (out.get("message") or out.get("error") or "") if isinstance(out, dict) \
                else str(out)
            if resp.status in (502, 503, 504) or code == _UNAVAILABLE:
                raise _Unavailable(f"{self.host}:{self.port}: {message}")
            raise StoreError(f"etcd {path} at {self.host}:{self.port}: HTTP {resp.status} "
                             f"{message}"[:500])
        return out

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


class EtcdClient:
    """The store's client on an etcd cluster (see the module doc). Thread-safe, one
    request at a time (give each thread that blocks its own, as with ``KVClient``)."""

    def __init__(self, endpoints: list[tuple[str, int]], store_key: bytes, timeout_s: float,
                 tls: EtcdTLS | None, failover_s: float = 10.0,
                 connect_timeout_s: float | None = None):
        if not endpoints:
            raise ValueError("an etcd store needs at least one endpoint")
        self.endpoints = list(endpoints)
        self.timeout_s = timeout_s
        self.failover_s = failover_s
        context = tls.context() if tls is not None else None
        self._members = [_Member(h, p, context) for h, p in self.endpoints]
        # the member requests go to first: any, so that a job's clients spread over them
        self._at = random.randrange(len(self._members))
        self.failovers = 0                  # requests moved to another member
        self._lock = threading.Lock()
        self._prefix = run_prefix(store_key)
        self._keys = self._prefix + b"/k/"
        self._markers = self._prefix + b"/m/"
        self._client_id = os.urandom(8).hex()
        self._seq = itertools.count(1)
        self._lease: tuple[str, float] | None = None      # (lease id, granted at)
        self.ping(connect_timeout_s if connect_timeout_s is not None else failover_s)

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self.timeout_s)

    def close(self) -> None:
        with self._lock:
            for m in self._members:
                m.close()

    # --- transport -----------------------------------------------------------------------

    def _post(self, path: str, body: dict, within: float | None = None) -> dict:
        """``body`` to the member in use, or the next one while a member cannot answer,
        for up to ``within`` (default ``failover_s``) seconds."""
        deadline = time.monotonic() + (self.failover_s if within is None else within)
        delay, last = 0.01, None
        with self._lock:
            while True:
                member = self._members[self._at]
                try:
                    return member.post(path, body, max(0.05, min(
                        ATTEMPT_S, self.timeout_s, deadline - time.monotonic())))
                except _Unavailable as exc:
                    last = exc
                    self._at = (self._at + 1) % len(self._members)
                    self.failovers += 1
                if time.monotonic() + delay > deadline:
                    raise StoreClosed(f"no etcd member of {self._where()} answered within "
                                      f"{self.failover_s} s: {last}")
                if self._at == 0 or len(self._members) == 1:
                    time.sleep(delay)          # every member tried once: wait, then again
                    delay = min(delay * 2, 0.25)

    def _where(self) -> str:
        return ",".join(f"{h}:{p}" for h, p in self.endpoints)

    def _key(self, key: str | bytes) -> bytes:
        return self._keys + (key.encode() if isinstance(key, str) else bytes(key))

    def _txn(self, compare: list, success: list, failure: list = ()) -> dict:
        return self._post("/v3/kv/txn", {"compare": compare, "success": success,
                                         "failure": list(failure)})

    def _ranges(self, keys: list[bytes]) -> tuple[list[bytes | None], int]:
        """Each key's value (None: missing), read at one revision per ``TXN_OPS`` keys, and
        the revision of the last read."""
        out: list[bytes | None] = []
        revision = 0
        for i in range(0, len(keys), TXN_OPS):
            part = keys[i:i + TXN_OPS]
            answer = self._txn([], [{"request_range": {"key": _b64(k)}} for k in part])
            revision = int(answer.get("header", {}).get("revision", 0))
            for r in answer.get("responses", []):
                kvs = r.get("response_range", {}).get("kvs") or []
                out.append(_unb64(kvs[0].get("value")) if kvs else None)
        return out, revision

    # --- waiting -------------------------------------------------------------------------

    def _watch_put(self, key: bytes, after: int, deadline: float) -> None:
        """Returns once ``key`` may have been written at a revision after ``after`` (a put
        seen, the member gone, or ``WATCH_RECHECK_S`` passed: the caller reads again), or
        raises ``StoreTimeout`` at ``deadline``. A watch of its own, on a connection of its
        own, to the member in use."""
        now = time.monotonic()
        if now >= deadline:
            raise StoreTimeout("")
        recheck = min(deadline, now + WATCH_RECHECK_S)
        body = json.dumps({"create_request": {"key": _b64(key),
                                              "start_revision": str(after + 1)}}).encode()
        conn = self._members[self._at].open(min(ATTEMPT_S, recheck - now))
        try:
            conn.request("POST", "/v3/watch", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise _Unavailable(f"watch: HTTP {resp.status}")
            while (left := recheck - time.monotonic()) > 0:
                conn.sock.settimeout(left)
                try:
                    line = resp.readline()
                except socket.timeout:
                    return                       # nothing within the recheck: read again
                if not line:
                    raise _Unavailable("watch stream closed")
                if not line.strip():
                    continue
                result = json.loads(line).get("result", {})
                if result.get("compact_revision") not in (None, "0"):
                    return           # compacted past ``after``: the caller reads again
                if any(e.get("type", "PUT") == "PUT" for e in result.get("events") or []):
                    return
        except (OSError, http.client.HTTPException, ValueError, _Unavailable):
            # the member is gone or slow to answer: the next one, after a breath
            with self._lock:
                self._at = (self._at + 1) % len(self._members)
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        finally:
            conn.close()

    def _wait_all(self, keys: list[bytes], wait_s: float) -> list[bytes]:
        deadline = time.monotonic() + wait_s
        while True:
            values, revision = self._ranges(keys)
            missing = [k for k, v in zip(keys, values) if v is None]
            if not missing:
                return values
            try:
                self._watch_put(missing[0], revision, deadline)
            except StoreTimeout:
                raise StoreTimeout(f"store wait timed out after {wait_s} s, keys: " + ", ".join(
                    k[len(self._keys):].decode(errors="replace") for k in missing)[:500]) \
                    from None

    def _wait_s(self, timeout: float | timedelta | None) -> float:
        if timeout is None:
            return self.timeout_s
        return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)

    # --- exactly-once read-modify-write ----------------------------------------------------

    def _marker_lease(self) -> str:
        now = time.monotonic()
        if self._lease is None or now - self._lease[1] > MARKER_TTL_S / 2:
            answer = self._post("/v3/lease/grant", {"TTL": str(MARKER_TTL_S)})
            self._lease = (answer["ID"], now)
        return self._lease[0]

    def _update(self, key: str, change) -> bytes:
        """``change(old value or None) -> new value`` applied exactly once to ``key``, even
        across a retry on another member (see the module doc); the new value. One round
        trip for a key not yet written, two otherwise (the first try guesses it absent and
        its failure reads the key); more only when writers race."""
        marker = _b64(self._markers + f"{self._client_id}.{next(self._seq)}".encode())
        full = _b64(self._key(key))
        kv: dict | None = None                 # the key as last read (None: absent)
        while True:
            lease = self._marker_lease()
            old = _unb64(kv.get("value")) if kv is not None else None
            new = _b64(change(old))
            if kv is not None:
                guard = {"key": full, "target": "MOD", "result": "EQUAL",
                         "mod_revision": kv["mod_revision"]}
            else:
                guard = {"key": full, "target": "CREATE", "result": "EQUAL",
                         "create_revision": "0"}
            answer = self._txn(
                [guard],
                [{"request_put": {"key": full, "value": new}},
                 {"request_put": {"key": marker, "value": new, "lease": lease}}],
                [{"request_range": {"key": full}}, {"request_range": {"key": marker}}])
            if answer.get("succeeded"):
                return _unb64(new)
            found, done = (r.get("response_range", {}).get("kvs") or []
                           for r in answer["responses"])
            if done:          # an earlier try went through; only its answer was lost
                return _unb64(done[0].get("value"))
            kv = found[0] if found else None

    # --- the store's methods (``KVClient``'s) ---------------------------------------------

    def set(self, key: str, value: bytes | str) -> None:
        self._post("/v3/kv/put", {"key": _b64(self._key(key)), "value": _b64(_b(value))})

    def try_get(self, key: str) -> bytes | None:
        return self._ranges([self._key(key)])[0][0]

    def try_multi_get(self, keys: list[str]) -> list[bytes | None]:
        return self._ranges([self._key(k) for k in keys])[0] if keys else []

    def get(self, key: str, timeout: float | timedelta | None = None) -> bytes:
        return self._wait_all([self._key(key)], self._wait_s(timeout))[0]

    def add(self, key: str, delta: int) -> int:
        def change(old: bytes | None) -> bytes:
            base = as_int(old or b"")
            if base is None:
                raise StoreNotANumber(f"the value at {key[:200]!r} is not an integer")
            return str(base + int(delta)).encode()
        return int(self._update(key, change))

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        full, expected, desired = self._key(key), _b(expected), _b(desired)
        if expected:
            guard = {"key": _b64(full), "target": "VALUE", "result": "EQUAL",
                     "value": _b64(expected)}
        else:
            guard = {"key": _b64(full), "target": "CREATE", "result": "EQUAL",
                     "create_revision": "0"}
        answer = self._txn([guard], [{"request_put": {"key": _b64(full),
                                                       "value": _b64(desired)}}],
                           [{"request_range": {"key": _b64(full)}}])
        if answer.get("succeeded"):
            return desired
        kvs = answer["responses"][0].get("response_range", {}).get("kvs") or []
        return _unb64(kvs[0].get("value")) if kvs else expected

    def check(self, keys: list[str]) -> bool:
        return all(v is not None for v in self._ranges([self._key(k) for k in keys])[0])

    def wait(self, keys: list[str], timeout: float | timedelta | None = None) -> None:
        self._wait_all([self._key(k) for k in keys], self._wait_s(timeout))

    def delete_key(self, key: str) -> bool:
        answer = self._post("/v3/kv/deleterange", {"key": _b64(self._key(key))})
        return int(answer.get("deleted", 0)) > 0

    def delete_keys(self, keys: list[str]) -> int:
        """Delete ``keys`` (those there), ``TXN_OPS`` a transaction: how many were there."""
        deleted = 0
        for i in range(0, len(keys), TXN_OPS):
            answer = self._txn([], [{"request_delete_range": {"key": _b64(self._key(k))}}
                                    for k in keys[i:i + TXN_OPS]])
            deleted += sum(int(r.get("response_delete_range", {}).get("deleted", 0))
                           for r in answer.get("responses", []))
        return deleted

    def num_keys(self) -> int:
        answer = self._post("/v3/kv/range", {"key": _b64(self._keys),
                                             "range_end": _b64(_range_end(self._keys)),
                                             "count_only": True})
        return int(answer.get("count", 0))

    def append(self, key: str, value: bytes | str) -> None:
        value = _b(value)
        self._update(key, lambda old: (old or b"") + value)

    def multi_get(self, keys: list[str], timeout: float | timedelta | None = None
                  ) -> list[bytes]:
        return self._wait_all([self._key(k) for k in keys], self._wait_s(timeout))

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        if len(keys) != len(values):
            raise ValueError(f"multi_set: {len(keys)} keys but {len(values)} values")
        puts = [{"request_put": {"key": _b64(self._key(k)), "value": _b64(_b(v))}}
                for k, v in zip(keys, values)]
        for i in range(0, len(puts), TXN_OPS):
            self._txn([], puts[i:i + TXN_OPS])

    def list_keys(self) -> list[str]:
        answer = self._post("/v3/kv/range", {"key": _b64(self._keys),
                                             "range_end": _b64(_range_end(self._keys)),
                                             "keys_only": True})
        return [_unb64(kv["key"])[len(self._keys):].decode(errors="replace")
                for kv in answer.get("kvs") or []]

    def ping(self, within: float | None = None) -> None:
        self._post("/v3/maintenance/status", {}, within)


def _b(x: bytes | str) -> bytes:
    return x.encode() if isinstance(x, str) else bytes(x)
