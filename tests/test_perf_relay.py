"""The straggler detector's measurements on their way (``agent/perfs.py``,
``control/stragglers.py``): a worker's meter sends each window on its channel, its agent
writes one signed ``HostPerf`` for the host and announces it in its beat, and the
controller's feed reads only the hosts that announced something, judges the windows off the
supervision round and hands the verdicts back. On a real store in this process, the
channels real socket pairs, the agent's reader and beat thread the real ones."""
import json
import socket
import time
from types import SimpleNamespace

import pytest

from trainmover.agent.beat import HostBeat
from trainmover.agent.perfs import Perfs
from trainmover.agent.votes import Channels
from trainmover.comm.groups import StoreClients, start_store_server
from trainmover.control.stragglers import PerfFeed, Stragglers
from trainmover.core import protocol as P
from trainmover.core.auth import AuthStore
from trainmover.core.codec import Table
from trainmover.core.config import StragglerConfig
from trainmover.core.topology import Role
from trainmover.worker.liveness import Inbox
from trainmover.worker.perf import StepMeter

SECRET = b"p" * 64
DEADLINE_S = 20


def wait_for(what, timeout_s=DEADLINE_S):
    deadline = time.monotonic() + timeout_s
    while True:
        got = what()
        if got:
            return got
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.fixture
def server():
    server = start_store_server(timeout_s=20, run_key=SECRET)
    yield server


def perf(role: str, last: int, compute_s: float, window: int = 8) -> P.StepPerf:
    return P.StepPerf(role, last - window + 1, last, 0, compute_s, compute_s, {"dp": 0.0},
                      recent=[P.PerfWindow(last - window + 1, last, compute_s)])


class Groups:
    def slots(self):
        return {}


def test_a_hosts_measurements_reach_the_store_as_one_value_its_beat_announces(server):
    """Two processes' meters send their windows on their channels; the agent writes one
    ``HostPerf`` with both, then a beat with its ``seq``; nothing new, nothing written; junk
    on a channel is reported and left out; a process that exited is left out at the next
    value."""
    store = AuthStore(server.client(), SECRET)
    rejected = []
    perfs = Perfs(on_reject=lambda name, why: rejected.append((name, why)))
    children = {}
    channels = Channels(lambda *a: None, None, lambda child, raw: perfs.received(child.name, raw))
    meters = {}
    for pid, name in enumerate(["w0", "w1"], start=100):
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        mine.setblocking(False)
        children[name] = SimpleNamespace(name=name, channel=mine, beats=1,
                                         beat_at=time.monotonic(),
                                         proc=SimpleNamespace(pid=pid, returncode=None))
        channels.add(children[name])
        inbox = Inbox(theirs, StoreClients(server.address, timeout_s=20))
        meters[name] = (StepMeter(inbox.send, name, f"dp{pid - 100}.pp0.tp0", 0, 4, {}, True,
                                  True), inbox)
    HostBeat(AuthStore(server.client(), SECRET), 3, 0.05, 10.0,
             lambda: list(children.values()), perfs)
    for step in range(4):
        for meter, _ in meters.values():
            meter.begin(step, Groups())
            meter.end(step, 0.01, Groups())

    def announced():
        beat = P.read_message(P.HostBeat, store.get(P.agent_key(3, "hb")))
        if not beat.perf:
            return None
        host = P.read_message(P.HostPerf, store.get(P.agent_key(3, "perf")))
        return (beat, host) if host.seq >= beat.perf and len(host.workers) == 2 else None

    beat, host = wait_for(announced)
    assert {w: (p.role, p.first_step, p.last_step) for w, p in host.workers.items()} == \
        {"w0": ("dp0.pp0.tp0", 0, 3), "w1": ("dp1.pp0.tp0", 0, 3)}
    seq = perfs.seq
    time.sleep(0.3)                      # several beats, no new window: no new value
    assert perfs.seq == seq

    meters["w1"][1].send(b"p " + json.dumps({"role": 3}).encode())
    wait_for(lambda: rejected)
    assert rejected[0][0] == "w1" and "StepPerf" in rejected[0][1]
    children["w1"].proc.returncode = 0   # w1 exited: its window goes with the next value
    for step in range(4, 8):
        meter = meters["w0"][0]
        meter.begin(step, Groups())
        meter.end(step, 0.01, Groups())
    host = wait_for(lambda: (lambda h: h if h.seq > seq else None)(
        P.read_message(P.HostPerf, store.get(P.agent_key(3, "perf")))))
    assert list(host.workers) == ["w0"] and host.workers["w0"].last_step == 7


def feed_ctx(store, workers: dict[str, Role], events: list):
    membership = SimpleNamespace(workers=Table(workers), standbys={})
    return SimpleNamespace(
        cfg=SimpleNamespace(straggler=StragglerConfig(check_interval_s=0.0), train=None),
        store=store, membership=membership, committed=0,
        events=SimpleNamespace(emit=lambda event, **kw: events.append((event, kw))),
        progress=SimpleNamespace(say=lambda text: None))


def test_the_feed_reads_the_hosts_it_is_given_and_takes_only_genuine_windows_of_role_holders(
        server):
    store, raw = AuthStore(server.client(), SECRET), server.client()
    events = []
    roles = {"w0": Role(0, 0, 0), "w1": Role(1, 0, 0), "w2": Role(2, 0, 0)}
    feed = PerfFeed(feed_ctx(store, roles, events), AuthStore(server.client(), SECRET))
    store.set(P.agent_key(0, "perf"), P.write_message(P.HostPerf(1, {
        "w0": perf("dp0.pp0.tp0", 7, 0.1),
        "w1": perf("dp9.pp0.tp0", 7, 0.1),          # a role it no longer holds: passed over
        "s5": perf("dp0.pp0.tp0", 7, 0.1)})))       # no role holder: passed over
    # host 1's value planted unsigned by someone who reaches the store: no window of w2's
    raw.set(P.agent_key(1, "perf"), P.write_message(P.HostPerf(9, {
        "w2": perf("dp2.pp0.tp0", 7, 5.0)})))
    store.set(P.agent_key(2, "perf"), P.write_message(P.HostPerf(1, {
        "w2": perf("dp2.pp0.tp0", 7, 0.1)})))
    _, latest = feed.collect({0, 1})
    assert set(latest) == {"w0"}
    _, latest = feed.collect({2})                  # only the hosts given are read
    assert set(latest) == {"w0", "w2"} and latest["w2"]["compute_s"] == 0.1


def test_a_slow_worker_is_reported_from_verdicts_judged_on_the_feeds_thread(server):
    """The round hands the feed the hosts whose beats moved and acts on what comes back:
    three workers on three hosts, one 1.5x slower; reported once as a straggler."""
    store = AuthStore(server.client(), SECRET)
    events = []
    roles = {f"w{i}": Role(i, 0, 0) for i in range(3)}
    ctx = feed_ctx(store, roles, events)
    ctx.cfg.straggler = StragglerConfig(check_interval_s=0.0, policy="alert")
    moved = set()
    health = SimpleNamespace(read_hosts=lambda now: None,
                             perf_moved=lambda: (moved.copy(), moved.clear())[0])
    clients = []

    def connect():
        clients.append(AuthStore(server.client(), SECRET))
        return clients[-1]

    stragglers = Stragglers(ctx, migrations=None, health=health, connect=connect)
    for k in range(10):
        last = 8 * k + 7
        for i in range(3):
            store.set(P.agent_key(i, "perf"), P.write_message(P.HostPerf(k + 1, {
                f"w{i}": perf(f"dp{i}.pp0.tp0", last, 0.15 if i == 2 else 0.1)})))
            moved.add(i)

        def caught_up():
            stragglers.poll()
            return stragglers.latest and all(p["last_step"] == last
                                             for p in stragglers.latest.values())

        wait_for(caught_up)
    found = [kw for e, kw in events if e == "straggler_detected"]
    assert [f["worker"] for f in found] == ["w2"] and len(clients) == 1
    assert stragglers._thread is not None and stragglers._thread.name == "straggler-feed"
