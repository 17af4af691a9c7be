"""The commit vote relayed by each host's agent (``agent/votes.py``, ``worker/liveness.
HostVote``): on a real store in this process, two "hosts" of two voters each, their
processes' channels real socket pairs."""
import socket
import threading
import time
from types import SimpleNamespace

import pytest

from trainmover.agent.votes import Channels, VoteRelay
from trainmover.comm.groups import AbortSignal, StoreClients, start_store_server
from trainmover.core import protocol as P
from trainmover.core.auth import AuthStore
from trainmover.worker.liveness import HostVote, Inbox

SECRET = b"h" * 64


@pytest.fixture
def job():
    server = start_store_server(timeout_s=20, run_key=SECRET)
    stores = StoreClients(server.address, timeout_s=20)
    relays, all_channels = {}, {}
    for node in (0, 1):
        relay = VoteRelay(AuthStore(server.client(), SECRET), AuthStore(server.client(), SECRET),
                          node, num_voters=4, coalesce_s=0.2)
        relays[node] = relay
        channels = Channels(relay.vote)
        all_channels[node] = channels
    workers = {}
    for i, name in enumerate(["w0", "w1", "w2", "w3"]):
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        mine.setblocking(False)
        child = SimpleNamespace(name=name, channel=mine, beats=0)
        all_channels[i // 2].add(child)
        relays[i // 2].expect(name)          # started as a worker there
        workers[name] = SimpleNamespace(channel=theirs, child=child, node=i // 2,
                                        inbox=Inbox(theirs, stores))
    yield SimpleNamespace(server=server, stores=stores, relays=relays, workers=workers,
                          channels=all_channels)
    server.close()


def vote_all(job, names, epoch, step, signal=None):
    """Each named worker's ``HostVote`` in a thread; their decisions."""
    out = {}

    def one(name):
        vote = HostVote(job.workers[name].inbox, job.stores, epoch,
                        signal or AbortSignal(), voter=name)
        out[name] = vote(step, {})

    threads = [threading.Thread(target=one, args=(n,), daemon=True) for n in names]
    for t in threads:
        t.start()
    return threads, out


@pytest.mark.timeout(60)
def test_a_step_commits_with_one_ballot_a_host_and_every_voter_hears_it(job):
    threads, out = vote_all(job, ["w0", "w1", "w2", "w3"], epoch=0, step=3)
    for t in threads:
        t.join(10)
    assert out == {"w0": True, "w1": True, "w2": True, "w3": True}
    store = job.stores.get()
    assert store.valid(P.commit_key(0, 3, "decision")) == b"commit"
    assert store.raw.add(P.commit_key(0, 3, "votes"), 0) == 4
    lines = [x for x in store.raw.get(P.commit_key(0, 3, "ballots")).split(b"\n") if x]
    assert len(lines) == 2                               # a ballot a host
    assert store.ballot_voters(P.commit_key(0, 3, "ballots")) == {"w0", "w1", "w2", "w3"}


@pytest.mark.timeout(60)
def test_a_missing_voter_leaves_the_step_to_the_controllers_abort(job):
    """w3 never votes (it died): nothing commits; the controller's compare-and-set of
    "abort" is what every voter hears, relayed or, once its epoch's abort signal fires,
    read from the store itself."""
    signal = AbortSignal()
    threads, out = vote_all(job, ["w0", "w1", "w2"], epoch=0, step=5, signal=signal)
    time.sleep(0.5)                                     # the coalescing passed: ballots in
    store = job.stores.get()
    assert store.raw.add(P.commit_key(0, 5, "votes"), 0) == 3
    assert not out and store.valid(P.commit_key(0, 5, "decision")) is None
    assert store.compare_set(P.commit_key(0, 5, "decision"), "", "abort") == b"abort"
    for t in threads:
        t.join(10)
    assert out == {"w0": False, "w1": False, "w2": False}


@pytest.mark.timeout(60)
def test_a_late_vote_goes_in_a_ballot_of_its_own(job):
    """Host 1's w3 votes after its host's ballot went with w2's alone (the relay held
    w2's for the coalescing time, then cast it): its own ballot completes the count, and
    the step commits."""
    threads, out = vote_all(job, ["w0", "w1", "w2"], epoch=1, step=0)
    time.sleep(0.5)
    assert not out
    late, out_late = vote_all(job, ["w3"], epoch=1, step=0)
    for t in threads + late:
        t.join(10)
    assert out == {"w0": True, "w1": True, "w2": True} and out_late == {"w3": True}
    lines = [x for x in job.stores.get().raw.get(P.commit_key(1, 0, "ballots")).split(b"\n")
             if x]
    assert len(lines) == 3


@pytest.mark.timeout(60)
def test_forged_host_ballots_and_a_forged_count_commit_nothing(job):
    """Someone past the store's handshake (signing nothing) appends host ballot lines
    naming the missing voter and bumps the count to the job's voter count: the relay whose
    add reaches the count finds three genuine voters, and does not commit."""
    raw = job.server.client()
    key = P.commit_key(0, 7, "ballots")
    raw.append(key, b"\nhost:1:w3\n")
    raw.append(key, b"\ntm1:" + b"0" * 64 + b":host:1:w3\n")
    raw.add(P.commit_key(0, 7, "votes"), 1)
    threads, out = vote_all(job, ["w0", "w1", "w2"], epoch=0, step=7)
    time.sleep(0.5)
    store = job.stores.get()
    assert store.raw.add(P.commit_key(0, 7, "votes"), 0) == 4     # the count is there
    assert not out and store.valid(P.commit_key(0, 7, "decision")) is None
    assert store.ballot_voters(key) == {"w0", "w1", "w2"}
    late, _ = vote_all(job, ["w3"], epoch=0, step=7)
    for t in threads + late:
        t.join(10)
    assert out == {"w0": True, "w1": True, "w2": True}


@pytest.mark.timeout(60)
def test_a_forged_decision_planted_first_is_waited_past(job):
    """An unsigned "commit" sits at the step's decision key before anyone votes, and one
    voter never comes: the relays' waits (a get that returns the planted value at once) do
    not take it, and every voter hears the controller's genuine "abort", which replaces
    it; the relays kept looking at the ballots meanwhile, not spinning on the store."""
    raw = job.server.client()
    decision = P.commit_key(2, 4, "decision")
    raw.set(decision, b"commit")
    threads, out = vote_all(job, ["w0", "w1", "w2"], epoch=2, step=4)
    time.sleep(0.6)
    assert not out
    before = job.server.server.requests
    time.sleep(0.5)
    # two relays polling the planted value every FORGED_POLL_S (a get and a ballot read):
    # ~40 requests in 0.5 s; spinning on it would be thousands
    assert job.server.server.requests - before < 200
    store = job.stores.get()
    assert store.compare_set(decision, "", "abort") == b"abort"
    for t in threads:
        t.join(10)
    assert out == {"w0": False, "w1": False, "w2": False}


@pytest.mark.timeout(60)
def test_the_channels_count_beats_and_hand_on_votes():
    votes = []
    channels = Channels(lambda child, epoch, step, voter: votes.append((child.name, epoch,
                                                                        step, voter)))
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    mine.setblocking(False)
    child = SimpleNamespace(name="w5", channel=mine, beats=0)
    channels.add(child)
    for message in (P.CHANNEL_BEAT, P.CHANNEL_BEAT, b"junk", P.vote_message(2, 9, "w5"),
                    P.CHANNEL_BEAT):
        theirs.send(message)
    deadline = time.monotonic() + 10
    while (child.beats < 3 or not votes) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert child.beats == 3 and votes == [("w5", 2, 9, "w5")]
    channels.remove(child)
    deadline = time.monotonic() + 10
    while mine.fileno() != -1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert mine.fileno() == -1                 # closed by the reader, not under its select


@pytest.mark.timeout(60)
def test_at_scale_a_relay_waiting_on_a_slow_step_reads_the_count_not_every_ballot(monkeypatch):
    """A step not decided within ``RECHECK_ALL_S``: with every host reading every host's
    ballot line at each re-check, a slow step cost O(hosts^2) through the store (at 2,048
    simulated hosts the first step never committed). In a job of many hosts a relay that
    is not the last to add reads the count; the ballots only as one of the step's deputies,
    or once the count is complete with no decision (an erased ballot may be its own)."""
    from trainmover.agent import votes as V
    from trainmover.core import storeaddr

    monkeypatch.setattr(V, "RECHECK_ALL_S", 0.1)

    class Counting(AuthStore):
        def __init__(self, *args):
            super().__init__(*args)
            self.reads = 0

        def ballot_tally(self, key, hosts):
            self.reads += 1
            return super().ballot_tally(key, hosts)

    server = start_store_server(timeout_s=20, run_key=SECRET)
    try:
        def agents_client():        # as the agent's (a torch store's timeout is no StoreTimeout)
            return storeaddr.connect(str(server.address), SECRET, 20)

        def relay_at(node, step, voter):
            wait_store = Counting(agents_client(), SECRET)
            relay = VoteRelay(AuthStore(agents_client(), SECRET), wait_store, node,
                              num_voters=4, coalesce_s=0.01, hosts=100_000)
            a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            relay.vote(SimpleNamespace(name=voter, channel=a), 0, step, voter)
            return wait_store, b

        plain, _ = relay_at(5, 7, "w0")     # no deputy of step 7: (5 - 7) mod hosts >= 2
        deputy, _ = relay_at(8, 8, "w1")    # one of step 8's: (8 - 8) mod hosts < 2
        time.sleep(1.0)                     # ~10 re-checks; one voter of four each
        assert plain.reads == 0 and deputy.reads >= 5
        # step 7's count complete, its ballots not (as if they were erased): host 5's
        # relay now reads them at each re-check (its own line is there: nothing to cast)
        server.client().add(P.commit_key(0, 7, "votes"), 3)
        time.sleep(0.6)
        assert plain.reads >= 3
        assert not server.client().check([P.commit_key(0, 7, "decision")])
    finally:
        server.close()


@pytest.mark.timeout(60)
def test_votes_coming_apart_after_the_hosts_ballot_go_together():
    """Host 0 expects six processes; one votes, the host's ballot goes with it after the
    coalescing time; four more vote apart within that time after it, the sixth later: the
    four are held and go with the sixth, in one more ballot (each in a ballot of its own
    before: a vote group's leader cast nearly one ballot a member at the job's store)."""
    server = start_store_server(timeout_s=20, run_key=SECRET)
    try:
        relay = VoteRelay(AuthStore(server.client(), SECRET), AuthStore(server.client(), SECRET),
                          0, num_voters=6, coalesce_s=1.0)
        children = []
        for i in range(6):
            a, _b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            a.setblocking(False)
            children.append((SimpleNamespace(name=f"w{i}", channel=a), _b))
            relay.expect(f"w{i}")
        key = P.commit_key(0, 1, "ballots")
        relay.vote(children[0][0], 0, 1, "w0")
        time.sleep(1.3)                                  # w0's ballot went at 1.0 s
        for child, _ in children[1:5]:
            relay.vote(child, 0, 1, child.name)
            time.sleep(0.05)
        relay.vote(children[5][0], 0, 1, "w5")
        deadline = time.monotonic() + 10
        store = AuthStore(server.client(), SECRET)
        while store.valid(P.commit_key(0, 1, "decision")) is None:
            assert time.monotonic() < deadline, "never decided"
            time.sleep(0.01)
        lines = [x for x in server.client().get(key).split(b"\n") if x]
        assert len(lines) == 2, lines
        assert store.valid(P.commit_key(0, 1, "decision")) == b"commit"
    finally:
        server.close()
