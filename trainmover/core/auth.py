"""The job's control plane is authenticated: every value a trainmover process writes to the
job's store carries an HMAC-SHA256 over its key and content under the run's key (derived
from the job's secret and the run's id: ``jobfile.start_run``), and every value it reads is
checked, so whoever can reach the store's port but lacks the secret can neither forge nor
alter a command, report, request, decision or the controller's snapshot, nor replay one
from another run.

- The secret is generated at launch (``create_secret``), 32 random bytes written as hex to
  ``<run dir>/secret`` with mode 0600 (the run dir itself is 0700); processes of the job read
  it from there, or from ``TRAINMOVER_SECRET`` (``load_secret``). It is never printed or logged.
- The MAC covers the key, so a value copied to another key is refused: a command or agent
  request copied to a later index (keys of lists carry their sequence number) is no replay.
- A value that fails the check raises ``AuthError`` (a ``MessageError``): the reader logs it
  and ignores it, as it does any malformed message. Where a key is decided or waited for,
  ``AuthStore`` treats a forged value as absent (``compare_set``, ``wait_valid``, ``valid``),
  so planting one first gains nothing.

Since the store itself answers only clients that prove they hold the run's key
(``core/kvstore.py``), this is the second wall: what a process of the job writes by mistake,
or a client past the first wall that does not sign, is still refused where it is read.
Counters (``add``) and key existence carry no signature, which is why the vote is checked
against signed ballots, queues skip holes (``core/queues.py``) and heartbeats are signed
beats rather than counters (``protocol.Beat``). The gloo/NCCL ports are the backends' own and
unauthenticated: across hosts they, like the store's traffic (authenticated at connection,
not encrypted), belong on a cluster network no outsider reaches (see docs/security.md).
"""
from __future__ import annotations

import collections
import hashlib
import hmac
import os
import secrets as _secrets
import time
from datetime import timedelta

from trainmover.core import ballots, kvstore, rundir
from trainmover.core.protocol import MessageError

SECRET_FILE = "secret"
SECRET_ENV = "TRAINMOVER_SECRET"
_TAG = b"tm1:"
_MAC_HEX = 64
# How often a key's forged values are replaced before giving up (each try is one round trip:
# an attacker who wins every race this many times in a row is flooding the store).
CAS_REPLACE_TRIES = 100
WAIT_VALID_POLL_S = 0.005      # waiting past a forged value until the genuine one lands
MAX_REJECTIONS_LOGGED = 10_000  # keys whose rejection is reported (once each)
MAX_COUNTERS_KEPT = 1024        # the counts last seen, kept to repair a forged counter
DEFAULT_STORE_TIMEOUT_S = 300.0  # a store object that does not say (test doubles)
KEYS_PER_READ = 1024            # keys read in one request (``read_raw``, ``read_valid``)
_HOST = ballots.HOST            # a host's ballot line (``cast_host_ballot``); no voter's name
HOST_BALLOT = _HOST.decode()


class AuthError(MessageError):
    """A store value without a valid MAC under the job's secret."""


def create_secret(run_dir: str) -> bytes:
    """A new secret for the job in ``run_dir`` (the file must not exist yet)."""
    secret = _secrets.token_hex(32).encode()
    fd = os.open(os.path.join(run_dir, SECRET_FILE), os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secret)
    return secret


def load_secret(run_dir: str | None = None) -> bytes:
    """The job's secret: ``TRAINMOVER_SECRET``, else ``<run dir>/secret``."""
    env = os.environ.get(SECRET_ENV)
    if env:
        return env.encode()
    path = os.path.join(run_dir or ".", SECRET_FILE)
    try:
        secret = rundir.read_bytes(path).strip()    # a planted symlink or file: refused
    except OSError as exc:
        raise ValueError(f"cannot read the job's secret {path!r}: {exc}") from exc
    if len(secret) < 32:
        raise ValueError(f"the job's secret in {path!r} is too short")
    return secret


def _mac(secret: bytes, key: str, payload: bytes) -> bytes:
    return hmac.new(secret, key.encode() + b"\0" + payload, hashlib.sha256).hexdigest().encode()


def seal(secret: bytes, key: str, value: str | bytes) -> bytes:
    payload = value.encode() if isinstance(value, str) else value
    return _TAG + _mac(secret, key, payload) + b":" + payload


def unseal(secret: bytes, key: str, raw: bytes) -> bytes:
    head = len(_TAG) + _MAC_HEX
    if not (raw.startswith(_TAG) and raw[head:head + 1] == b":"):
        raise AuthError(f"{key}: value is not signed")
    payload = raw[head + 1:]
    if not hmac.compare_digest(raw[len(_TAG):head], _mac(secret, key, payload)):
        raise AuthError(f"{key}: bad signature")
    return payload


def store_timeout_s(store) -> float:
    """How long the store client's blocking calls wait (its ``timeout``)."""
    limit = getattr(store, "timeout", None)
    return limit.total_seconds() if limit is not None else DEFAULT_STORE_TIMEOUT_S


class _BallotCheck:
    """Checks ballot lines appended at one key, as bytes: each line's MAC before anything is
    decoded, the MAC keyed once and copied for each line (every line's starts with the same
    bytes)."""

    def __init__(self, secret: bytes, key: str):
        self._signed_for = hmac.new(secret, key.encode() + b"#", hashlib.sha256)

    def line(self, line: bytes) -> tuple[bytes, bytes] | None:
        """A genuine line's signer (``host:<node>`` or the voter) and its names, else None."""
        head = len(_TAG) + _MAC_HEX + 1
        if len(line) < head or not line.startswith(_TAG) or line[head - 1] != 0x3A:
            return None                           # not a signed line (0x3A: ":")
        payload = line[head:]
        if payload.startswith(_HOST):
            end = payload.find(b":", len(_HOST))
            if end < 0:
                return None
            signer, names = payload[:end], payload[end + 1:]
        else:
            signer = names = payload
        mac = self._signed_for.copy()
        mac.update(signer + b"\0" + payload)
        if not hmac.compare_digest(line[len(_TAG):head - 1], mac.hexdigest().encode()):
            return None
        return signer, names

    def lines(self, value: bytes) -> list[tuple[bytes, bytes]]:
        """(signer, names) of each genuine line of ``value``."""
        out = []
        for line in value.split(b"\n"):
            got = self.line(line)
            if got is not None:
                out.append(got)
        return out


def host_ballots(secret: bytes, key: str, value: bytes) -> list[tuple[int, list[str]]]:
    """The genuine host ballots (``AuthStore.cast_host_ballot``) in ``value``, a write
    appended at ``key``: each as (node, its own processes' voters). Lines of single voters,
    forged lines and anything else appended count for nothing. What a group's leader reads
    of its members' ballots as they come (``agent/groupvote.py``)."""
    out = []
    for signer, names in _BallotCheck(secret, key).lines(value):
        node = signer[len(_HOST):]
        if not signer.startswith(_HOST) or not node.isdigit():
            continue
        own = [voters for host, voters in ballots.segments(signer, names) if host == node]
        if own:
            out.append((int(node), own[0].decode(errors="replace").split(",")))
    return out


class AuthStore:
    """A store client whose values are signed on write and checked on read (see the module
    doc); everything else passes through. Wraps any object with a torch store's methods.

    A value nobody with the secret wrote (unsigned, forged) counts as absent where a key is
    decided or waited for: ``compare_set`` replaces it, ``wait_valid`` waits past it,
    ``valid`` reads it as None. ``on_reject(key, error)`` hears of each such key once."""

    def __init__(self, store, secret: bytes, on_reject=None):
        self.raw = store
        self._secret = secret
        self.on_reject = on_reject
        self._rejected: set[str] = set()
        self._counts: collections.OrderedDict[str, int] = collections.OrderedDict()

    def _reject(self, key: str, exc: AuthError) -> None:
        if key in self._rejected or len(self._rejected) >= MAX_REJECTIONS_LOGGED:
            return
        self._rejected.add(key)
        if self.on_reject is not None:
            self.on_reject(key, exc)

    def set(self, key: str, value: str | bytes) -> None:
        self.raw.set(key, seal(self._secret, key, value))

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        """Each key sealed as ``set`` would, all of them in one request."""
        self.raw.multi_set(keys, [seal(self._secret, k, v) for k, v in zip(keys, values)])

    def get(self, key: str) -> bytes:
        return unseal(self._secret, key, self.raw.get(key))

    def valid(self, key: str) -> bytes | None:
        """The key's value if it exists and is genuine, else None (a forged one is
        reported to ``on_reject``)."""
        try_get = getattr(self.raw, "try_get", None)     # one round trip where it can
        if try_get is not None:
            raw = try_get(key)
        else:
            raw = self.raw.get(key) if self.raw.check([key]) else None
        if raw is None:
            return None
        try:
            return unseal(self._secret, key, raw)
        except AuthError as exc:
            self._reject(key, exc)
            return None

    def valid_many(self, keys: list[str]) -> list[bytes | None]:
        """``valid`` of each key, in one round trip where the store can (``try_multi_get``)."""
        many = getattr(self.raw, "try_multi_get", None)
        if many is None:
            return [self.valid(k) for k in keys]
        return [None if raw is None else self.genuine(key, raw)
                for key, raw in zip(keys, many(keys))]

    def genuine(self, key: str, raw: bytes) -> bytes | None:
        """The payload of ``raw``, read at ``key``, if it is genuine (else None, reported
        to ``on_reject``)."""
        try:
            return unseal(self._secret, key, raw)
        except AuthError as exc:
            self._reject(key, exc)
            return None

    def await_value(self, key: str, timeout: timedelta) -> bytes | None:
        """The key's value as soon as it exists, in one request (a ``get`` that waits): None
        where it is not genuine (reported to ``on_reject``); ``StoreTimeout`` when the key
        is not there within ``timeout``. A forged value planted first is answered at once:
        the caller looks again after its own poll."""
        return self.genuine(key, self.raw.get(key, timeout))

    def wait_valid(self, key: str, poll_s: float = WAIT_VALID_POLL_S) -> bytes:
        """Wait, up to the store's timeout, until the key holds a genuine value: one that
        was planted first (a forged decision) makes ``wait`` return early, but the genuine
        writer replaces it (``compare_set``) or overwrites it (``set``)."""
        deadline = time.monotonic() + store_timeout_s(self.raw)
        while True:
            raw = self.raw.get(key)        # waits for the key (up to the store's timeout)
            try:
                return unseal(self._secret, key, raw)
            except AuthError as exc:
                self._reject(key, exc)
            if time.monotonic() > deadline:
                raise AuthError(f"{key}: no genuine value within the store's timeout (forged "
                                f"ones kept being written there)")
            time.sleep(poll_s)

    def cast_ballot(self, key: str, voter: str) -> None:
        """Append this voter's signed ballot to ``key`` (one line; atomic on the server). The
        line starts with a newline too: junk planted at the key before the vote, with no
        newline of its own, would otherwise swallow the first ballot cast after it."""
        self.raw.append(key, b"\n" + seal(self._secret, f"{key}#{voter}", voter) + b"\n")

    def cast_host_ballot(self, key: str, node: int, voters: list[str],
                         members: dict[int, list[str]] | None = None) -> None:
        """A host's ballot: the voters of its processes its agent relays at once, and a vote
        group leader's members' (``members``: node -> voters), one signed line
        (``core/ballots.py``)."""
        self.raw.append(key, self._host_line(key, node, voters, members))

    def cast_host_ballot_and_count(self, key: str, node: int, voters: list[str],
                                   counter: str,
                                   members: dict[int, list[str]] | None = None) -> int:
        """``cast_host_ballot``, then ``add(counter, <its voters>)``: in one write where the
        store can (``KVClient.append_then_add``), the count repaired as ``add`` repairs it."""
        line = self._host_line(key, node, voters, members)
        n = len(voters) + sum(len(v) for v in (members or {}).values())
        both = getattr(self.raw, "append_then_add", None)
        if both is None:
            self.raw.append(key, line)
            return self.add(counter, n)
        try:
            return self._counted(counter, both(key, line, counter, n))
        except kvstore.StoreNotANumber:
            return self.add(counter, n)      # the ballot is in: count again

    def _host_line(self, key: str, node: int, voters: list[str],
                   members: dict[int, list[str]] | None = None) -> bytes:
        return b"\n" + seal(self._secret, f"{key}#{HOST_BALLOT}{node}",
                            ballots.payload(node, voters, members)) + b"\n"

    def ballot_voters(self, key: str) -> set[str]:
        """The distinct voters whose genuine ballots ``key`` holds, a voter's own or in a
        host's (forged lines, copies of a ballot and anything else appended there count for
        nothing). The caller cast its ballot there first: the key exists (one round trip, no
        check). Every name in a set: ``ballot_tally`` counts without, for the deciding agent."""
        return ballots.voters(_BallotCheck(self._secret, key).lines(self.raw.get(key)))

    def ballot_tally(self, key: str, hosts: set[int]) -> tuple[int, set[str]]:
        """How many distinct voters the genuine ballots at ``key`` name (as
        ``ballot_voters``), and which of them are on ``hosts`` (the caller's own and its vote
        group's members': those it cast). One MAC a line, checked on the bytes (keyed once
        and copied for each line); names gathered only for ``hosts`` and for a host found in
        two lines (``core/ballots.py``): the step's deciding agent reads every host's line
        on the step's path (2,048 hosts, flat: 6.8-7.2 ms when every name went into one set).
        """
        return ballots.tally(_BallotCheck(self._secret, key).lines(self.raw.get(key)), hosts)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """Set ``desired`` if the key holds ``expected`` ("" = absent, which a forged value
        also counts as: it is replaced); returns the value the key holds afterwards
        (checked)."""
        want = seal(self._secret, key, expected) if expected else expected
        sealed = seal(self._secret, key, desired)
        for _ in range(CAS_REPLACE_TRIES):
            got = self.raw.compare_set(key, want, sealed)
            try:
                return unseal(self._secret, key, got)
            except AuthError as exc:
                if expected:
                    raise
                self._reject(key, exc)
                want = got        # nobody of the job wrote it: replace exactly that value
        raise AuthError(f"{key}: forged values kept taking its place ({CAS_REPLACE_TRIES} "
                        f"tries)")

    def add(self, key: str, amount: int) -> int:
        """A counter's ``add``. No process of the job ``set``s a counter, so a value there
        that is no number was forged: it is replaced by the count this client saw last
        (every counter is a hint its readers cross-check: ballots, skipped queue holes) and
        the count goes on, instead of the caller failing."""
        for _ in range(CAS_REPLACE_TRIES):
            try:
                value = self.raw.add(key, amount)
                break
            except kvstore.StoreNotANumber:
                self._reject(key, AuthError(f"{key}: a counter holding no number"))
                try:
                    junk = self.raw.get(key)
                except Exception:  # noqa: BLE001 - deleted meanwhile: count afresh
                    continue
                if kvstore.is_count(junk):
                    continue      # another client repaired it meanwhile: count on
                self.raw.compare_set(key, junk, str(self._counts.get(key, 0)))
        else:
            raise AuthError(f"{key}: forged values kept taking the counter's place "
                            f"({CAS_REPLACE_TRIES} tries)")
        return self._counted(key, value)

    def _counted(self, key: str, value: int) -> int:
        """``value``, kept as the last count seen at ``key`` (what a forged value there is
        replaced by)."""
        self._counts[key] = value
        self._counts.move_to_end(key)
        if len(self._counts) > MAX_COUNTERS_KEPT:
            self._counts.popitem(last=False)
        return value

    def check(self, keys: list[str]) -> bool:
        return self.raw.check(keys)

    def ping(self) -> None:
        ping_store(self.raw)

    def wait(self, keys: list[str], *timeout) -> None:
        self.raw.wait(keys, *timeout)

    def delete_key(self, key: str) -> bool:
        return self.raw.delete_key(key)

    def delete_keys(self, keys: list[str]) -> int:
        return delete_keys(self.raw, keys)


def delete_keys(store, keys: list[str]) -> int:
    """Delete ``keys`` from ``store``: in batches where it takes them (ours, etcd), else one
    by one (torch's own store). How many were there."""
    many = getattr(store, "delete_keys", None)
    if many is not None:
        return many(keys)
    return sum(bool(store.delete_key(k)) for k in keys)


def ping_store(store) -> None:
    """Raises if ``store`` cannot be reached (through a host's door: if the door lost the
    store; the door answers an idle connection's ping itself, ``core/kvproxy.py``). A store
    without a ping (torch's own) is asked whether a key exists."""
    ping = getattr(store, "ping", None)
    if ping is not None:
        ping()
    else:
        store.check(["_"])


class PlainStore:
    """A store used without a secret (tests, tools that only count): AuthStore's reading
    methods over plain values, everything else passed through."""

    def __init__(self, store):
        self.raw = store

    def __getattr__(self, name):
        return getattr(self.raw, name)

    def ping(self) -> None:
        ping_store(self.raw)

    def delete_keys(self, keys: list[str]) -> int:
        return delete_keys(self.raw, keys)

    def valid(self, key: str) -> bytes | None:
        return self.raw.get(key) if self.raw.check([key]) else None

    def await_value(self, key: str, timeout: timedelta) -> bytes | None:
        return self.raw.get(key, timeout)

    def wait_valid(self, key: str) -> bytes:
        self.raw.wait([key])
        return self.raw.get(key)

    def cast_ballot(self, key: str, voter: str) -> None:
        self.raw.append(key, voter.encode() + b"\n")

    def cast_host_ballot(self, key: str, node: int, voters: list[str],
                         members: dict[int, list[str]] | None = None) -> None:
        self.raw.append(key, (ballots.payload(node, voters, members) + "\n").encode())

    def cast_host_ballot_and_count(self, key: str, node: int, voters: list[str],
                                   counter: str,
                                   members: dict[int, list[str]] | None = None) -> int:
        self.cast_host_ballot(key, node, voters, members)
        return self.raw.add(counter, len(voters) + sum(len(v) for v in
                                                       (members or {}).values()))

    def _lines(self, key: str) -> list[tuple[bytes, bytes]]:
        out = []
        for line in self.raw.get(key).split(b"\n"):
            if line.startswith(ballots.HOST):
                end = line.find(b":", len(ballots.HOST))
                if end > 0:
                    out.append((line[:end], line[end + 1:]))
            elif line:
                out.append((line, line))
        return out

    def ballot_voters(self, key: str) -> set[str]:
        return ballots.voters(self._lines(key))

    def ballot_tally(self, key: str, hosts: set[int]) -> tuple[int, set[str]]:
        return ballots.tally(self._lines(key), hosts)


def read_raw(store: AuthStore, keys: list[str]) -> list[bytes | None]:
    """The keys' values as stored (undecoded, unchecked): ``KEYS_PER_READ`` keys a request
    where the store can (one round trip a key was most of the controller's round at a
    thousand workers)."""
    many = getattr(store.raw, "try_multi_get", None)
    if many is None:
        return [store.raw.get(k) if store.raw.check([k]) else None for k in keys]
    out = []
    for i in range(0, len(keys), KEYS_PER_READ):
        out += many(keys[i:i + KEYS_PER_READ])
    return out


def read_valid(store, keys: list[str]) -> list[bytes | None]:
    """``store.valid`` of each key, ``KEYS_PER_READ`` keys a request where the store can."""
    many = getattr(store, "valid_many", None)
    out = []
    for i in range(0, len(keys), KEYS_PER_READ):
        part = keys[i:i + KEYS_PER_READ]
        out += many(part) if many is not None else [store.valid(k) for k in part]
    return out
