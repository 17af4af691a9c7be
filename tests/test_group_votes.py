"""The commit vote through vote groups (``agent/groupvote.py``): four "hosts" in this
process, in groups of two ({0, 1} led by host 1, {2, 3} led by host 3), two voters each,
the job's store and the leaders' stores real servers, the processes' channels real socket
pairs."""
import socket
import threading
import time
from types import SimpleNamespace

import pytest

from trainmover.agent import groupvote
from trainmover.agent.votes import Channels, VoteRelay
from trainmover.comm.groups import StoreClients, start_store_server
from trainmover.core import kvstore, storeaddr
from trainmover.core import protocol as P
from trainmover.core.auth import AuthStore, seal
from trainmover.core.config import AgentConfig
from trainmover.worker.liveness import Inbox

from test_host_votes import vote_all

SECRET = b"g" * 64
HOSTS, SIZE, VOTERS = 4, 2, 8


class Job:
    def __init__(self, leader_timeout_s: float = 5.0):
        self.server = start_store_server(timeout_s=20, run_key=SECRET)
        self.stores = StoreClients(self.server.address, timeout_s=20)
        self.relays, self.leaders, self.left, self.workers = {}, {}, {}, {}
        for node in range(HOSTS):
            relay = VoteRelay(self.client(), self.client(), node, num_voters=VOTERS,
                              coalesce_s=0.2, hosts=HOSTS // SIZE, root_index=node // SIZE)
            self.relays[node] = relay
            members = groupvote.group_of(node, HOSTS, SIZE)
            if node == members[-1]:
                leader = groupvote.GroupLeader(SECRET, "127.0.0.1", node, members, relay,
                                               kvstore.StoreLimits(), 20)
                self.client().set(P.agent_key(node, "votes"), leader.address)
                self.leaders[node] = leader
            else:
                relay.on_left_group = lambda why, node=node: self.left.setdefault(node, why)
                relay.group = groupvote.GroupLink(SECRET, members[-1], self.client(),
                                                  leader_timeout_s, relay.leave_group)
            channels = Channels(relay.vote)
            for i in (2 * node, 2 * node + 1):
                name = f"w{i}"
                mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                mine.setblocking(False)
                child = SimpleNamespace(name=name, channel=mine, beats=0)
                channels.add(child)
                relay.expect(name)
                self.workers[name] = SimpleNamespace(inbox=Inbox(theirs, self.stores))
        deadline = time.monotonic() + 10
        while not all(r.group.ready() for r in self.relays.values() if r.group is not None):
            assert time.monotonic() < deadline, "the members never reached their leaders"
            time.sleep(0.01)

    def client(self) -> AuthStore:
        return AuthStore(storeaddr.connect(str(self.server.address), SECRET, 20), SECRET)

    def vote(self, names, epoch, step, signal=None):
        """Each named worker's ``HostVote`` in a thread; their decisions."""
        return vote_all(self, names, epoch, step, signal)

    def all_vote(self, epoch, step, timeout_s=20):
        threads, out = self.vote(list(self.workers), epoch, step)
        for t in threads:
            t.join(timeout_s)
        return out

    def root_lines(self, epoch, step):
        raw = self.stores.get().raw.get(P.commit_key(epoch, step, "ballots"))
        return [x for x in raw.split(b"\n") if x]

    def close(self):
        for leader in self.leaders.values():
            leader.close()
        self.server.close()


@pytest.fixture
def job():
    j = Job()
    yield j
    j.close()


def everyone(decision: bool) -> dict:
    return {f"w{i}": decision for i in range(VOTERS)}


def test_groups_are_runs_of_consecutive_hosts_led_by_their_last():
    assert [list(groupvote.group_of(n, 7, 3)) for n in (0, 2, 3, 6)] == \
        [[0, 1, 2], [0, 1, 2], [3, 4, 5], [6]]
    assert [groupvote.leader_of(n, 7, 3) for n in range(7)] == [2, 2, 2, 5, 5, 5, 6]
    agent = AgentConfig()
    assert [agent.vote_group_size(n) for n in (1, 8, 63, 64, 2048, 12_500)] == \
        [1, 1, 1, 8, 46, 112]
    # on etcd, where racing hosts' writes take a round each, from 4 hosts
    assert [agent.vote_group_size(n, etcd=True) for n in (3, 4, 16, 64)] == [1, 2, 4, 8]
    assert AgentConfig(vote_group_hosts=1).vote_group_size(4096) == 1
    assert AgentConfig(vote_group_hosts=16).vote_group_size(4) == 4
    for bad in (-1, 2.5, True, "4"):
        with pytest.raises(ValueError, match=r"agent\.vote_group_hosts"):
            AgentConfig(vote_group_hosts=bad).validate()


@pytest.mark.timeout(60)
def test_a_step_commits_with_one_ballot_a_group_at_the_jobs_store(job):
    assert job.all_vote(0, 0) == everyone(True)
    # from the second step on each leader waits for its member host as for its own
    # processes: one line a group at the job's store, naming every voter
    assert job.all_vote(0, 1) == everyone(True)
    lines = job.root_lines(0, 1)
    assert len(lines) == HOSTS // SIZE
    assert sorted(line.split(b":", 4)[3] for line in lines) == [b"1", b"3"]   # the leaders'
    store = job.stores.get()
    assert store.ballot_voters(P.commit_key(0, 1, "ballots")) == set(everyone(True))
    assert store.valid(P.commit_key(0, 1, "decision")) == b"commit"
    # the members' ballots and the decision went through the leader's store
    group = AuthStore(kvstore.connect("127.0.0.1", job.leaders[1].server.port, SECRET, 20),
                      SECRET)
    assert group.ballot_voters(P.commit_key(0, 1, "ballots")) == {"w0", "w1"}
    assert group.valid(P.commit_key(0, 1, "decision")) == b"commit"
    assert not job.left


@pytest.mark.timeout(60)
def test_a_missing_voter_leaves_the_step_to_the_controllers_abort_through_the_group(job):
    """w0 (host 0, a member) never votes: nothing commits; the controller's "abort" at the
    job's store reaches host 0's other voter through its leader."""
    names = [n for n in job.workers if n != "w0"]
    threads, out = job.vote(names, 1, 0)
    time.sleep(0.8)
    assert not out
    assert job.stores.get().compare_set(P.commit_key(1, 0, "decision"), "", "abort") == b"abort"
    for t in threads:
        t.join(10)
    assert out == {n: False for n in names}


@pytest.mark.timeout(60)
def test_a_member_whose_leaders_store_closed_votes_at_the_jobs_store(job):
    """Host 1's group store goes (its agent died; here only its store, so that its own
    voters can still vote): host 0 leaves the group, casts at the job's store, and the step
    commits."""
    assert job.all_vote(0, 0) == everyone(True)
    job.leaders[1].close()
    assert job.all_vote(0, 1) == everyone(True)
    assert "store" in job.left[0] and job.relays[0].group is None
    voters = job.stores.get().ballot_voters(P.commit_key(0, 1, "ballots"))
    assert voters == set(everyone(True))
    assert job.all_vote(0, 2) == everyone(True)          # and on, without a group
    assert list(job.left) == [0]


@pytest.mark.timeout(60)
def test_a_member_leaves_its_leader_once_the_leader_is_declared_lost(job):
    """Host 3's agent stops relaying its members' ballots (its store still answers): host
    2's voters wait, nothing commits, until the controller declares host 3 lost; host 2
    then casts again at the job's store and the step commits."""
    job.leaders[3].server.on_append = None
    threads, out = job.vote(list(job.workers), 0, 0)
    time.sleep(1.0)
    assert not out and not job.left
    job.client().set(P.agent_key(3, "fenced"), "lost")
    for t in threads:
        t.join(20)
    assert out == everyone(True)
    assert "declared lost" in job.left[2]


@pytest.mark.timeout(60)
def test_a_member_leaves_a_leader_that_stopped_answering():
    """Host 1's store stops answering (its agent hung): host 0's cast is not answered
    within ``agent.vote_group_timeout_s``, and it votes at the job's store instead."""
    job = Job(leader_timeout_s=1.0)
    hang = threading.Event()
    try:
        assert job.all_vote(0, 0) == everyone(True)
        job.leaders[1].server.on_append = lambda key, value: hang.wait(30)
        assert job.all_vote(0, 1) == everyone(True)
        assert 0 in job.left
    finally:
        hang.set()
        job.close()


@pytest.mark.timeout(60)
def test_forged_and_misplaced_ballots_in_a_groups_store_count_for_nothing(job):
    """Past the group store's handshake: an unsigned line naming w4 (host 2's), a genuine
    ballot of host 2 naming it signed for another step's key, and a genuine ballot of host
    0 (another group's host) naming w4 and w5: host 3's leader relays none of them; the
    step commits only when w4 itself votes."""
    assert job.all_vote(0, 0) == everyone(True)
    group = kvstore.connect("127.0.0.1", job.leaders[3].server.port, SECRET, 20)
    key = P.commit_key(0, 1, "ballots")
    group.append(key, b"\nhost:2:w4\n")
    group.append(key, b"\n" + seal(SECRET, f"{P.commit_key(0, 0, 'ballots')}#host:2",
                                   b"host:2:w4") + b"\n")
    group.append(key, b"\n" + seal(SECRET, f"{key}#host:0", b"host:0:w4,w5") + b"\n")
    names = [n for n in job.workers if n != "w4"]         # w4: host 2's first voter
    threads, out = job.vote(names, 0, 1)
    time.sleep(1.0)
    assert not out
    assert "w4" not in job.stores.get().ballot_voters(key)
    late, out_late = job.vote(["w4"], 0, 1)
    for t in threads + late:
        t.join(20)
    assert out == {n: True for n in names} and out_late == {"w4": True}
