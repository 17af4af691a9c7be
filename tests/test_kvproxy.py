"""A host's door to the store (core/kvproxy.py): its processes' connections, whatever their
number, reach the store as streams of one connection, each served as a connection of its
own would be."""
import socket
import threading
import time

import pytest
from hypothesis import example, given, settings, strategies as st

from trainmover.core import kvproxy
from trainmover.core.kvserver import KVServer
from trainmover.core.kvstore import (MAGIC, NONCE_BYTES, REQUEST, STREAM, KVClient, Op,
                                     StoreClosed, StoreLimits, StoreRefused, StoreTimeout,
                                     connect_socket, encode_request, store_key, tag_request)

import test_kvstore

RUN_KEY = b"k" * 32
KEY = store_key(RUN_KEY)


@pytest.fixture
def server():
    srv = KVServer.listen(KEY)
    yield srv
    srv.close()


def door_of(srv, limits=StoreLimits()):
    return kvproxy.serve(RUN_KEY, "127.0.0.1", srv.port, 5.0, limits=limits)


def client(srv_or_door, key=KEY, timeout_s=5.0):
    return KVClient("127.0.0.1", srv_or_door.port, key, timeout_s)


@pytest.mark.timeout(60)
def test_many_connections_through_the_door_are_one_at_the_store_and_do_not_block_each_other(
        server):
    """Eight processes' connections are one at the store. One blocked in a get holds none of
    the others; a set answers it; its requests stay in order (appends, then an add)."""
    door = door_of(server)
    try:
        clients = [client(door) for _ in range(8)]
        for i, c in enumerate(clients):
            c.set(f"k{i}", str(i))
        assert server.connections() == 1 and door.connections() == 8
        got = {}
        blocked = threading.Thread(target=lambda: got.update(v=clients[0].get("late", 10)))
        blocked.start()
        time.sleep(0.2)
        assert blocked.is_alive()
        for i in range(1, 8):          # answered while client 0 waits
            assert clients[i].get(f"k{i}") == str(i).encode()
            assert clients[i].add("count", 1) == i
        for i in range(100):
            clients[1].append("log", f"{i},")
        assert clients[1].add("count", 1) == 8      # after its appends
        assert clients[2].get("log").endswith(b"98,99,")
        clients[3].set("late", "here")
        blocked.join(5)
        assert got == {"v": b"here"}
        with pytest.raises(StoreTimeout):
            clients[4].wait(["never"], timeout=0.3)
        assert clients[4].add("count", 0) == 8     # served on after a timeout
    finally:
        door.close()


@pytest.mark.timeout(60)
def test_a_closed_connection_ends_its_stream_and_its_wait_in_the_store(server):
    door = door_of(server)
    try:
        c = client(door)
        t = threading.Thread(target=lambda: pytest.raises(StoreClosed, c.get, "never", 30))
        t.start()
        time.sleep(0.2)
        assert server._waiters              # the wait, in the store
        c._sock.shutdown(socket.SHUT_RDWR)  # as the process's death would
        t.join(5)
        deadline = time.monotonic() + 5
        while server._waiters and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not server._waiters
        assert client(door).add("n", 1) == 1
    finally:
        door.close()


@pytest.mark.timeout(60)
def test_the_door_answers_only_the_runs_key_and_forwards_no_stream_of_a_stream(server):
    door = door_of(server)
    try:
        with pytest.raises(StoreRefused):
            client(door, key=store_key(b"another run"))
        # a door that does not hold the client's key is refused by the client
        with pytest.raises(StoreRefused):
            kvproxy.serve(b"another run", "127.0.0.1", server.port, 5.0)
        # a request already a stream's, past the handshake: that connection is closed
        sock = connect_socket("127.0.0.1", door.port, KEY, 5.0)
        sock.sendall(tag_request(encode_request(Op.SET, [b"x", b"1"])[4:], 7))
        sock.settimeout(5)
        assert sock.recv(64) == b""
        c = client(door)
        assert not c.check(["x"]) and door.refused == 1
        # raw bytes without the handshake reach nothing
        raw = socket.create_connection(("127.0.0.1", door.port), timeout=5)
        assert raw.recv(len(MAGIC) + NONCE_BYTES).startswith(MAGIC)
        raw.sendall(encode_request(Op.SET, [b"y", b"1"]))
        time.sleep(0.2)
        assert not c.check(["y"])
    finally:
        door.close()


@pytest.mark.timeout(60)
def test_a_request_that_comes_a_byte_at_a_time_is_forwarded_whole(server):
    """TCP may cut a frame anywhere: after its length, before its op (the door once read
    the op byte before it came, and its thread died with every host's connection)."""
    door = door_of(server)
    try:
        sock = connect_socket("127.0.0.1", door.port, KEY, 5.0)
        sock.settimeout(5)
        for b in encode_request(Op.ADD, [b"n"], 3):
            sock.sendall(bytes([b]))
            time.sleep(0.002)
        answer = sock.recv(64)
        assert answer[4] == 0 and int.from_bytes(answer[5:13], "big") == 3
        assert client(door).add("n", 1) == 4
    finally:
        door.close()


@pytest.mark.timeout(60)
def test_a_refused_write_that_answers_nothing_closes_only_its_own_connection():
    """At the store it would close the connection: through the door it ends that stream,
    and the door closes the one connection it forwards."""
    srv = KVServer.listen(KEY, limits=StoreLimits(max_key_bytes=64))
    door = door_of(srv)
    try:
        a, b = client(door), client(door)
        a.append("n", "1,")
        a.append("k" * 65, "too long a key")
        with pytest.raises(StoreClosed):
            a.get("n")
        assert b.get("n") == b"1," and srv.connections() == 1
    finally:
        door.close()
        srv.close()


@pytest.mark.timeout(60)
def test_streams_past_the_limit_are_refused_one_by_one():
    srv = KVServer.listen(KEY, limits=StoreLimits(max_streams=3))
    door = door_of(srv)
    try:
        # (a request the store answers: an idle connection's ping is the door's)
        kept = [client(door) for _ in range(3)]
        for c in kept:
            c.check(["x"])
        extra = client(door)
        with pytest.raises(StoreClosed):
            extra.check(["x"])
        kept[0].close()                      # its stream ends: room for one more
        time.sleep(0.2)
        client(door).check(["x"])
        assert kept[1].add("n", 1) == 1
    finally:
        door.close()
        srv.close()


@pytest.mark.timeout(60)
def test_when_the_store_is_gone_so_is_every_connection_through_the_door():
    srv = KVServer.listen(KEY)
    door = door_of(srv)
    try:
        c, idle = client(door), client(door)
        c.set("a", "1")
        idle.ping()                       # answered by the door
        srv.close()
        with pytest.raises(StoreClosed):
            for _ in range(50):
                c.get("a")
                time.sleep(0.05)
        with pytest.raises(StoreClosed):  # nor is a ping answered once the store is lost
            idle.ping()
        assert door.upstream_error is not None
        with pytest.raises(StoreClosed):
            KVClient("127.0.0.1", door.port, KEY, 1.0, connect_timeout_s=1.0).get("a")
    finally:
        door.close()


@pytest.mark.timeout(60)
def test_the_door_answers_an_idle_connections_ping_and_forwards_one_behind_a_request(server):
    """A process waiting for a command checks its store every second: at the job's size
    that is as many requests a second at the store. The door answers an idle connection's
    ping itself; a ping behind a request still unanswered goes to the store, so the answers
    keep their order."""
    door = door_of(server)
    try:
        c = client(door)
        c.set("x", "1")
        served = server.requests
        for _ in range(20):
            c.ping()
        assert door.pinged == 20 and server.requests == served
        # pipelined: a get that waits in the store, then a ping
        sock = connect_socket("127.0.0.1", door.port, KEY, 5.0)
        sock.sendall(encode_request(Op.GET, [b"late"], timeout_ms=10000) +
                     encode_request(Op.PING))
        time.sleep(0.3)
        assert door.pinged == 20
        c.set("late", "v")
        sizes = _answers(sock, 2, timeout_s=10)
        assert sizes[0] > sizes[1]        # the get's value first, then the ping's bare OK
        assert server.requests == served + 3      # the get, the set, the ping
    finally:
        door.close()


@pytest.mark.timeout(60)
def test_a_malformed_stream_request_at_the_store_is_an_error_of_that_stream_only(server):
    """A multiplexed connection sends a stream request too short to carry its id: the store
    closes that connection (as any malformed frame); a well-formed one is answered with
    its stream's id."""
    sock = connect_socket("127.0.0.1", server.port, KEY, 5.0)
    sock.settimeout(5)
    sock.sendall(tag_request(encode_request(Op.ADD, [b"n"], 5)[4:], 42))
    answer = sock.recv(64)
    assert answer[4] & 0x40 and STREAM.unpack_from(answer, 4 + 13)[0] == 42
    bad = bytes([Op.PING | 0x40]) + bytes(REQUEST.size - 1)
    sock.sendall(len(bad).to_bytes(4, "big") + bad)
    assert sock.recv(64) == b""
    assert client(server).add("n", 0) == 5


@pytest.mark.timeout(120)
@settings(max_examples=40, deadline=None)
@given(st.lists(test_kvstore._ops, max_size=25))
def test_through_the_door_the_store_answers_as_torchs_own_store_does(ops):
    import torch.distributed as dist

    srv = KVServer.listen(KEY)
    door = door_of(srv)
    try:
        mine, theirs = client(door), dist.HashStore()
        for op in ops:
            if op[0] == "add" and theirs.check([op[1]]) and \
                    not test_kvstore._strict_int(theirs.get(op[1])):
                continue
            a, b = test_kvstore._apply(mine, op), test_kvstore._apply(theirs, op)
            if isinstance(a, str) and isinstance(b, str) and a != "missing":
                continue
            assert a == b, (op, a, b)
    finally:
        door.close()
        srv.close()


_frames = st.lists(st.one_of(
    st.binary(max_size=40),                                   # anything at all
    st.builds(lambda op, sid, body: bytes([op]) + body[:REQUEST.size - 1] +
              sid.to_bytes(4, "big") + body[REQUEST.size - 1:],
              st.integers(0, 255), st.integers(0, 2**32 - 1), st.binary(max_size=40)),
).map(lambda body: len(body).to_bytes(4, "big") + body), max_size=6)


@pytest.mark.timeout(300)
@settings(max_examples=100, deadline=None)
@given(_frames, st.integers(0, 64), st.booleans())
@example([], 4, True)     # a frame's length alone: it once killed the door's thread
def test_no_bytes_from_a_client_with_the_key_stop_the_store_or_a_door(frames, cut,
                                                                      through_door):
    """Whatever frames a client past the handshake sends (plain or a stream's, malformed),
    and a frame cut anywhere (its length included) on another connection, the store and
    the door serve on: a third client is answered."""
    srv = KVServer.listen(KEY, limits=StoreLimits(max_streams=4))
    door = door_of(srv) if through_door else None
    target = door or srv
    try:
        sock = connect_socket("127.0.0.1", target.port, KEY, 5.0)
        for frame in frames:
            try:
                sock.sendall(frame)
            except OSError:
                break                 # hung up on: fine
        cut_sock = connect_socket("127.0.0.1", target.port, KEY, 5.0)
        whole = encode_request(Op.ADD, [b"m"], 1)
        cut_sock.sendall(whole[:cut % len(whole)])
        other = client(target)
        assert other.add("n", 1) == 1
        assert srv.serving() and (door is None or door.serving())
        sock.close()
        cut_sock.close()
    finally:
        if door is not None:
            door.close()
        srv.close()


def _send_what_is_taken(sock, data, seconds):
    """Send ``data`` without blocking for ``seconds`` at most (or until all of it is sent),
    then let the other side settle: the bytes taken."""
    sock.setblocking(False)
    sent, deadline = 0, time.monotonic() + seconds
    while sent < len(data) and time.monotonic() < deadline:
        try:
            sent += sock.send(data[sent:])
        except BlockingIOError:
            time.sleep(0.01)
    time.sleep(0.5)
    return sent


def _answers(sock, n, timeout_s=30.0):
    """Read ``n`` framed answers off ``sock``: their sizes, in order."""
    sock.settimeout(timeout_s)
    buf, sizes = bytearray(), []
    while len(sizes) < n:
        chunk = sock.recv(1 << 20)
        assert chunk, "closed before every answer came"
        buf += chunk
        while len(buf) >= 4 and len(buf) >= 4 + int.from_bytes(buf[:4], "big"):
            size = int.from_bytes(buf[:4], "big")
            sizes.append(size)
            del buf[:4 + size]
    return sizes


@pytest.mark.timeout(60)
def test_a_connection_that_takes_no_answers_is_not_read_past_the_bound_and_loses_nothing():
    """A process with the key sends gets of a large value and reads none of the answers:
    the store stops reading it once more than ``max_unsent_bytes`` wait for it (its memory
    bounded, not the 50 MB asked for), serves the others meanwhile, and once the answers
    are taken it reads again: every one comes, in order."""
    limits = StoreLimits(max_unsent_bytes=1 << 20)
    srv = KVServer.listen(KEY, limits=limits)
    try:
        client(srv).set("big", b"v" * (256 << 10))
        greedy = connect_socket("127.0.0.1", srv.port, KEY, 5.0)
        n = 200
        ask = encode_request(Op.GET, [b"big"], timeout_ms=1000)
        data = ask * n
        sent = _send_what_is_taken(greedy, data, 10)
        held = [c for c in list(srv._conns) if c.held]
        assert len(held) == 1
        assert len(held[0].outbuf) <= (1 << 20) + (256 << 10) + 64
        other = client(srv)
        assert other.add("n", 1) == 1            # the store serves on
        greedy.setblocking(True)
        greedy.sendall(data[sent:])
        sizes = _answers(greedy, n)
        assert all(s == sizes[0] for s in sizes) and sizes[0] > (256 << 10)
        # The last answer can reach us before the store's thread, back from its send,
        # marks the connection read again: allow it that moment.
        deadline = time.monotonic() + 5
        while held[0].held and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not held[0].held                  # read again
        greedy.sendall(encode_request(Op.ADD, [b"n"], number=1))
        _answers(greedy, 1)
        assert other.add("n", 0) == 2
    finally:
        srv.close()


@pytest.mark.timeout(60)
def test_the_door_stops_reading_its_processes_while_the_store_takes_nothing():
    """The store's connection does not take what the door forwards (a store stalled): the
    door stops reading its processes once more than ``max_unsent_bytes`` wait for the store,
    and forwards everything once the store reads again."""
    limits = StoreLimits(max_unsent_bytes=1 << 20)
    store_end, door_end = socket.socketpair()
    door = kvproxy.KVProxy(KEY, socket.create_server(("127.0.0.1", 0)), door_end, limits)
    try:
        proc = connect_socket("127.0.0.1", door.port, KEY, 5.0)
        one = encode_request(Op.SET | 0x80, [b"k", b"x" * (64 << 10)])   # NO_REPLY
        n = 300                                         # ~19 MB
        data = one * n
        sent = _send_what_is_taken(proc, data, 5)
        assert sent < len(data)                         # the door stopped taking them
        held = [c for c in list(door._conns) if c.held]
        assert len(held) == 1
        assert len(door._up.outbuf) <= (1 << 20) + len(one) + 4 + 4   # one frame past it
        got = bytearray()
        proc.setblocking(True)
        sender = threading.Thread(target=proc.sendall, args=(data[sent:],))
        sender.start()
        store_end.settimeout(10)
        want = n * (len(one) + 4)                       # each tagged with its stream
        while len(got) < want:
            got += store_end.recv(1 << 20)
        sender.join(10)
        assert len(got) == want and not held[0].held
    finally:
        door.close()
        store_end.close()


@pytest.mark.timeout(60)
def test_a_worker_waiting_for_a_command_checks_its_store_at_its_door(server, monkeypatch):
    """A worker blocked in ``CommandChannel.next`` (a recovery's survivors wait for the
    plan there) checks every ``STORE_CHECK_S`` that its store is there: through its host's
    door, a ping the door answers, none of them a request at the job's store. Once the door
    loses the store the check fails and the worker says its job is gone."""
    from trainmover.comm.groups import StoreAddress, StoreClients
    from trainmover.worker import commands

    monkeypatch.setattr(commands, "STORE_CHECK_S", 0.05)
    door = door_of(server)
    try:
        stores = StoreClients(StoreAddress("127.0.0.1", door.port, RUN_KEY), timeout_s=5)
        stores.get().set("warm", "1")            # its connection open (a stream at the store)
        channel = commands.CommandChannel(stores, None, "w0")
        served = server.requests
        threading.Timer(1.0, channel.queue.put, args=({"command": 1},)).start()
        assert channel.next() == {"command": 1}
        assert door.pinged >= 10 and server.requests == served
        server.close()
        with pytest.raises(RuntimeError, match="store is gone"):
            channel.next()
    finally:
        door.close()
