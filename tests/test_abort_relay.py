"""The controller's aborts relayed by the host's agent (``agent/aborts.py``) to its workers'
``Inbox`` (``worker/liveness.py``): on a real store in this process, the processes'
channels real socket pairs, the agent's reader of them the real ``Channels``."""
import socket
import time
from types import SimpleNamespace

import pytest

from trainmover.agent import aborts
from trainmover.agent.aborts import AbortRelay
from trainmover.agent.votes import Channels
from trainmover.comm.groups import AbortSignal, StoreClients, start_store_server
from trainmover.core import protocol as P
from trainmover.core.auth import AuthStore
from trainmover.worker.liveness import Inbox

SECRET = b"r" * 64


@pytest.fixture
def host():
    """One host's agent side (relay and channels' reader) and its processes' inboxes."""
    server = start_store_server(timeout_s=20, run_key=SECRET)
    stores = StoreClients(server.address, timeout_s=20)
    connects = []

    def connect():
        connects.append(1)
        return AuthStore(server.client(), SECRET)

    relay = AbortRelay(connect)
    channels = Channels(lambda *a: None, relay.watch)
    procs = {}

    def start(name):
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        mine.setblocking(False)
        child = SimpleNamespace(name=name, channel=mine, beats=0)
        channels.add(child)
        procs[name] = SimpleNamespace(child=child, channel=theirs, inbox=Inbox(theirs, stores))
        return procs[name]

    yield SimpleNamespace(server=server, stores=stores, relay=relay, channels=channels,
                          start=start, procs=procs, connects=connects)
    server.close()


def abort(stores, epoch, reason="w7 failed"):
    """The controller's abort, as it writes it (signed, compare-and-set)."""
    stores.get().compare_set(P.abort_key(epoch), "", reason)


def waiters(server, key):
    return len(server.server._waiters.get(key.encode(), ()))


@pytest.mark.timeout(60)
def test_an_abort_reaches_every_watcher_of_the_host_through_one_wait(host):
    signals = {}
    for name in ("w0", "w1", "w2"):
        proc = host.start(name)
        signals[name] = AbortSignal()
        proc.inbox.watch_abort(signals[name], 3)
    deadline = time.monotonic() + 10
    while waiters(host.server, P.abort_key(3)) < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)            # every ask read by now: still one wait in the store
    assert waiters(host.server, P.abort_key(3)) == 1 and len(host.connects) == 1
    assert not any(s.is_set() for s in signals.values())
    abort(host.stores, 3)
    for s in signals.values():
        assert s.wait(10)
        assert s.reason == "epoch 3 aborted: w7 failed"
    # the epoch's watch is over: its client closed, nothing waits in the store any more
    deadline = time.monotonic() + 10
    while waiters(host.server, P.abort_key(3)) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert waiters(host.server, P.abort_key(3)) == 0


@pytest.mark.timeout(60)
def test_a_forged_abort_is_waited_past_and_a_late_ask_hears_the_genuine_one(host):
    """An unsigned value at the abort key (someone past the store's handshake) fires
    nothing; the controller's compare-and-set replaces it and fires; a process that asks
    after that is told at once."""
    early = host.start("w0")
    signal = AbortSignal()
    early.inbox.watch_abort(signal, 5)
    raw = host.server.client()
    raw.set(P.abort_key(5), b"forged")
    assert not signal.wait(0.5)
    abort(host.stores, 5, "w3 failed")
    assert signal.wait(10) and signal.reason == "epoch 5 aborted: w3 failed"
    late = host.start("w1")
    signal_late = AbortSignal()
    late.inbox.watch_abort(signal_late, 5)
    assert signal_late.wait(10) and signal_late.reason == "epoch 5 aborted: w3 failed"


@pytest.mark.timeout(60)
def test_a_later_epoch_or_an_exit_ends_the_watch_of_an_epoch(host, monkeypatch):
    monkeypatch.setattr(aborts, "IDLE_CHECK_S", 0.2)
    w0, w1 = host.start("w0"), host.start("w1")
    s0, s1 = AbortSignal(), AbortSignal()
    w0.inbox.watch_abort(s0, 1)
    w1.inbox.watch_abort(s1, 1)
    deadline = time.monotonic() + 10
    while waiters(host.server, P.abort_key(1)) < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    s2 = AbortSignal()
    w0.inbox.watch_abort(s2, 2)                 # w0 moved on
    time.sleep(1.0)
    assert waiters(host.server, P.abort_key(1)) == 1     # w1 still asks
    host.relay.forget("w1")                     # w1 exited
    deadline = time.monotonic() + 10
    while waiters(host.server, P.abort_key(1)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert waiters(host.server, P.abort_key(1)) == 0
    assert waiters(host.server, P.abort_key(2)) == 1
    abort(host.stores, 2)
    assert s2.wait(10)
    assert not s0.is_set() and not s1.is_set()   # epoch 1 was never aborted


@pytest.mark.timeout(60)
def test_a_full_channel_gets_the_abort_once_the_process_reads_again(host):
    """The process is not reading (stopped): the agent's sends find its channel full; the
    abort is offered again until it is taken."""
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    mine.setblocking(False)
    child = SimpleNamespace(name="w0", channel=mine, beats=0)
    host.relay.watch(child, 4)
    filled = 0
    while True:
        try:
            mine.send(P.CHANNEL_BEAT)       # anything the process ignores
            filled += 1
        except BlockingIOError:
            break
    abort(host.stores, 4)
    time.sleep(0.3)                              # offered, refused: the channel is full
    signal = AbortSignal()
    inbox = Inbox(theirs, host.stores)           # the process reads again
    with inbox._cv:
        inbox._watches[4] = [signal]             # as its ask before it stopped
    assert signal.wait(10) and signal.reason == "epoch 4 aborted: w7 failed"
    assert filled > 0


@pytest.mark.timeout(60)
def test_a_gone_agent_hands_the_watches_to_the_store(host):
    """The agent's end closes: the epochs the process watched, and those it watches later,
    are waited for in the store by the process itself; the decisions are read there too."""
    proc = host.start("w0")
    before, after = AbortSignal(), AbortSignal()
    proc.inbox.watch_abort(before, 6)
    host.channels.remove(proc.child)             # closed by the reader: the agent is gone
    deadline = time.monotonic() + 10
    while not proc.inbox.closed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proc.inbox.closed
    proc.inbox.watch_abort(after, 7)
    assert proc.inbox.decision(6, 0, 0.1) is None    # at once: nobody relays
    abort(host.stores, 6)
    abort(host.stores, 7, "w2 failed")
    assert before.wait(10) and before.reason == "epoch 6 aborted: w7 failed"
    assert after.wait(10) and after.reason == "epoch 7 aborted: w2 failed"


def test_channel_messages_read_back_and_junk_is_none():
    assert P.read_watch_message(P.watch_message(12)) == 12
    assert P.read_abort_message(P.abort_message(3, "a b c")) == (3, "a b c")
    assert len(P.abort_message(1, "x" * 1000)) < P.CHANNEL_MAX
    for junk in (b"w", b"w -1", b"w 1 2", b"wx 1", b"a 1", b"a x y", b"d 1 2 commit", b""):
        assert P.read_watch_message(junk) is None
        assert P.read_abort_message(junk) is None


@pytest.mark.timeout(60)
def test_a_late_ask_on_a_full_channel_gets_the_abort_once_the_process_reads_again(host):
    """The abort fired before the process asked, and its channel is full when it asks (its
    reader stopped meanwhile): the abort is offered again until it is taken, not dropped."""
    abort(host.stores, 6)
    first = host.start("w1")
    signal = AbortSignal()
    with first.inbox._cv:                      # the epoch fires while someone watches it
        first.inbox._watches[6] = [signal]
    host.relay.watch(first.child, 6)
    assert signal.wait(10)
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    mine.setblocking(False)
    child = SimpleNamespace(name="w0", channel=mine, beats=0)
    while True:
        try:
            mine.send(P.CHANNEL_BEAT)           # anything the process ignores
        except BlockingIOError:
            break
    host.relay.watch(child, 6)                  # asks late, its channel full
    time.sleep(0.3)
    late = AbortSignal()
    inbox = Inbox(theirs, host.stores)           # the process reads again
    with inbox._cv:
        inbox._watches[6] = [late]
    assert late.wait(10) and late.reason == "epoch 6 aborted: w7 failed"
