"""The job's authenticated key-value store (core/kvstore.py): torch Store semantics for the
processes holding the run's key, nothing at all for anyone else."""
import os
import socket
import threading
import time

import pytest
from hypothesis import given, settings, strategies as st

from trainmover.core.kvserver import KVServer
from trainmover.core.kvstore import (MAGIC, NONCE_BYTES, REFUSED, KVClient, Op, StoreClosed,
                                     StoreError, StoreLimits, StoreNotANumber, StoreRefused,
                                     StoreTimeout, encode_request, store_key)

KEY = store_key(b"k" * 32)


@pytest.fixture
def server():
    srv = KVServer.listen(KEY)
    yield srv
    srv.close()


def client(srv, key=KEY, timeout_s=5.0):
    return KVClient("127.0.0.1", srv.port, key, timeout_s)


@pytest.mark.timeout(60)
def test_a_client_without_the_runs_key_is_refused_and_the_store_serves_on(server):
    c = client(server)
    c.set("decision", "commit")
    with pytest.raises(StoreRefused):
        client(server, key=store_key(b"another run"))
    # a server that does not hold the client's key is refused by the client as well
    other = KVServer.listen(store_key(b"another run"))
    try:
        with pytest.raises(StoreRefused):
            client(other)
    finally:
        other.close()
    assert c.get("decision") == b"commit"
    assert server.refused == 1


@pytest.mark.timeout(60)
def test_raw_bytes_at_the_port_reach_nothing():
    """What a local user can do with only the port: send a request frame (or garbage)
    without the handshake. The connection is closed (at once on a wrong proof, at the
    handshake's deadline on a short one); no key appears."""
    server = KVServer.listen(KEY, limits=StoreLimits(handshake_timeout_s=1.0))
    c = client(server)
    for junk in (encode_request(Op.SET, [b"controller/incarnation", b"9"]),
                 b"\x00" * 64, os.urandom(4096)):
        s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        assert s.recv(len(MAGIC) + NONCE_BYTES).startswith(MAGIC)
        s.sendall(junk)
        s.settimeout(5)
        answer = b""
        while chunk := s.recv(100):
            answer += chunk
        # hung up on: a wrong proof is told REFUSED first (the junk of 64 bytes and more)
        assert answer in (b"", REFUSED)
        s.close()
    assert c.num_keys() == 0 and not c.check(["controller/incarnation"])
    assert server.refused == 3
    server.close()


@pytest.mark.timeout(60)
def test_a_connection_dropped_in_the_handshake_is_retried_and_a_refusal_is_not():
    """The server keeps a bounded number of unauthenticated connections and closes the
    oldest: in a burst of thousands of workers connecting at once that is one of theirs. Its
    client connects again (a job of 256 simulated workers once failed to start on it); a
    client told REFUSED (another run's key) fails at once, not at its connect timeout."""

    class DropsFirst(KVServer):
        dropped = 0

        def _handshake(self, conn):
            if DropsFirst.dropped < 2 and len(conn.inbuf) >= NONCE_BYTES + 32:
                DropsFirst.dropped += 1
                self._close(conn)          # as an eviction: no answer at all
                return
            super()._handshake(conn)

    srv = DropsFirst.listen(KEY)
    try:
        c = client(srv, timeout_s=30.0)
        c.set("a", "1")
        assert c.get("a") == b"1" and DropsFirst.dropped == 2
        t = time.monotonic()
        with pytest.raises(StoreRefused):
            client(srv, key=store_key(b"another run"), timeout_s=30.0)
        assert time.monotonic() - t < 5
    finally:
        srv.close()


@pytest.mark.timeout(60)
def test_unauthenticated_connections_are_bounded_and_timed_out():
    srv = KVServer.listen(KEY, limits=StoreLimits(handshake_timeout_s=0.5, max_pending=4))
    try:
        idle = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(10)]
        c = client(srv)                     # still served, and first in line
        c.set("a", "1")
        assert c.get("a") == b"1"
        # the oldest idle ones were closed as the count passed 4, the rest at their deadline
        deadline = time.monotonic() + 10
        while srv.refused < 10 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert srv.refused == 10
        for s in idle:
            s.close()
    finally:
        srv.close()


@pytest.mark.timeout(60)
def test_waits_are_answered_when_the_keys_appear_and_time_out_otherwise(server):
    a, b = client(server), client(server)
    got = {}
    t = threading.Thread(target=lambda: got.update(v=a.get("late", timeout=10),
                                                   w=a.multi_get(["x", "y"], timeout=10)))
    t.start()
    time.sleep(0.2)
    b.set("late", "here")
    b.set("x", "1")
    time.sleep(0.1)
    b.delete_key("x")          # deleted before y came: the multi_get waits for it again
    b.set("y", "2")
    time.sleep(0.1)
    assert t.is_alive()
    b.set("x", "3")
    t.join(5)
    assert got == {"v": b"here", "w": [b"3", b"2"]}
    started = time.monotonic()
    with pytest.raises(StoreTimeout):
        a.wait(["never"], timeout=0.3)
    assert 0.25 < time.monotonic() - started < 3
    a.set("after", "ok")       # the connection serves on after a timeout
    assert b.get("after") == b"ok"


@pytest.mark.timeout(60)
def test_add_on_a_value_that_is_not_a_number_is_an_error_not_a_lost_connection(server):
    c = client(server)
    c.set("count", "junk")
    with pytest.raises(StoreError, match="not an integer"):
        c.add("count", 1)
    assert c.add("other", 2) == 2 and c.get("count") == b"junk"


@pytest.mark.timeout(60)
def test_an_oversized_frame_closes_only_its_connection():
    srv = KVServer.listen(KEY, limits=StoreLimits(max_frame_bytes=1 << 16))
    try:
        a, b = client(srv), client(srv)
        with pytest.raises(StoreClosed):
            a.set("big", b"x" * (1 << 17))
        b.set("fine", "yes")
        assert b.get("fine") == b"yes" and not b.check(["big"])
    finally:
        srv.close()


_keys = st.sampled_from(["a", "b", "c/d", "n"])
_values = st.one_of(st.binary(max_size=6), st.integers(-9, 99).map(lambda i: str(i).encode()))
_ops = st.one_of(
    st.tuples(st.just("set"), _keys, _values),
    st.tuples(st.just("add"), _keys, st.integers(-5, 5)),
    st.tuples(st.just("compare_set"), _keys, st.sampled_from([b"", b"1", b"x"]), _values),
    st.tuples(st.just("check"), st.lists(_keys, min_size=1, max_size=3)),
    st.tuples(st.just("delete_key"), _keys),
    st.tuples(st.just("num_keys")),
    st.tuples(st.just("append"), _keys, _values),
    st.tuples(st.just("get"), _keys),
)


def _strict_int(value: bytes) -> bool:
    try:
        return not value or str(int(value.decode("ascii"))).encode() == value
    except (UnicodeDecodeError, ValueError):
        return False


def _apply(store, op):
    name, *args = op
    try:
        if name == "get":
            if not store.check([args[0]]):
                return "missing"
        return getattr(store, name)(*args)
    except Exception as exc:        # noqa: BLE001 - compared by kind, not text
        return type(exc).__name__


@pytest.mark.timeout(120)
@settings(max_examples=60, deadline=None)
@given(st.lists(_ops, max_size=25))
def test_the_store_answers_as_torchs_own_store_does(ops):
    """Any sequence of operations answers as torch's HashStore answers it (add on a
    non-number aside: HashStore raises, this store raises too, and keeps the connection)."""
    import torch.distributed as dist

    srv = KVServer.listen(KEY)
    try:
        mine, theirs = client(srv), dist.HashStore()
        for op in ops:
            if op[0] == "add" and theirs.check([op[1]]) and \
                    not _strict_int(theirs.get(op[1])):
                continue     # torch's stoll reads a prefix of "5x" or " 5": this store refuses
            a, b = _apply(mine, op), _apply(theirs, op)
            if isinstance(a, str) and isinstance(b, str) and a != "missing":
                continue                  # both refused (exception types differ)
            assert a == b, (op, a, b)
        assert sorted(mine.list_keys()) == sorted(
            k for k in ("a", "b", "c/d", "n") if theirs.check([k]))
    finally:
        srv.close()


@pytest.mark.timeout(60)
def test_a_ballot_and_its_count_go_in_one_write_the_append_first(server):
    """``append_then_add``: the append is made before the add is answered (another client
    reading after the answer sees it); on a counter holding no number the add is refused
    as ``add`` is (the connection kept) and the append stays made."""
    a, b = client(server), client(server)
    assert a.append_then_add("ballots", b"h0,", "votes", 3) == 3
    assert a.append_then_add("ballots", b"h1,", "votes", 5) == 8
    assert b.get("ballots") == b"h0,h1," and b.add("votes", 0) == 8
    b.set("junk", b"not a number")
    with pytest.raises(StoreNotANumber):
        a.append_then_add("ballots", b"h2,", "junk", 1)
    assert a.get("ballots") == b"h0,h1,h2,"


@pytest.mark.timeout(60)
def test_appends_answer_nothing_yet_are_read_in_order_and_a_bad_one_ends_the_connection():
    srv = KVServer.listen(KEY, limits=StoreLimits(max_key_bytes=64))
    try:
        a, b = client(srv), client(srv)
        for i in range(200):
            a.append("n", f"{i},")      # no round trip each
        a.add("count", 1)               # answered after the appends before it
        assert b.get("n").endswith(b"198,199,")
        assert a.try_get("n").startswith(b"0,1,") and a.try_get("none") is None
        a.set("s", "x")                 # a set answers: any client sees it once it returned
        assert b.try_get("s") == b"x"
        a.append("k" * 65, "too long a key")   # refused: nobody to answer, so it hangs up
        with pytest.raises(StoreClosed):
            a.get("n")
        assert b.get("n").endswith(b"199,")
    finally:
        srv.close()


@pytest.mark.timeout(60)
def test_try_multi_get_reads_many_keys_or_their_absence_in_one_request(server):
    """What the controller reads every host's heartbeat with: values and absences, in
    order, empty values included, and no wait for a missing key."""
    c = client(server)
    c.set("a", "1")
    c.set("empty", "")
    before = server.requests
    assert c.try_multi_get(["a", "missing", "empty", "a"]) == [b"1", None, b"", b"1"]
    assert server.requests == before + 1
    assert c.try_multi_get([]) == []


@pytest.mark.timeout(60)
def test_delete_keys_removes_many_keys_in_few_requests_and_counts_those_there(server):
    """What the controller's key retention deletes with (a recovery's end dooms two keys a
    worker): ``DELETE_BATCH`` keys a request, missing ones counted out, the rest kept."""
    from trainmover.core.kvstore import DELETE_BATCH, Op

    c = client(server)
    n = 2 * DELETE_BATCH + 5
    names = [f"k{i}" for i in range(n)]
    c.multi_set(names, [b"v"] * n)
    c.set("kept", "1")
    before = server.requests
    assert c.delete_keys(names[:-3] + ["missing"]) == n - 3
    assert server.requests == before + 3
    assert c.num_keys() == 4 and c.try_multi_get(names[-3:] + ["kept"]) == [b"v"] * 3 + [b"1"]
    assert c.delete_keys([]) == 0 and c.delete_key("kept") and not c.delete_key("kept")
    # a delete naming no key is an error for its request, not the end of the connection
    with pytest.raises(StoreError, match="delete needs a key"):
        c._call(Op.DELETE, [])
    assert c.try_get(names[-1]) == b"v"
