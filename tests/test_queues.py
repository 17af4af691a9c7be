"""Numbered queues in the store (core/queues.py) under forged values: a forged head is not
consumed, a genuine value behind a hole is reached, nothing is read twice."""
import pytest
from hypothesis import given, settings, strategies as st

from trainmover.core.auth import AuthStore, PlainStore, seal
from trainmover.core.queues import SlotReader

SECRET = b"s" * 64


class DictStore:
    """The TCPStore methods the reader uses, over a dict."""

    def __init__(self):
        self.values, self.counters, self.requests = {}, {}, 0

    def check(self, keys):
        self.requests += 1
        return all(k in self.values for k in keys)

    def get(self, key):
        self.requests += 1
        return self.values[key]

    def set(self, key, value):
        self.values[key] = value.encode() if isinstance(value, str) else value

    def add(self, key, n):
        self.requests += 1
        self.counters[key] = self.counters.get(key, 0) + n
        return self.counters[key]


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def reader(raw, clock, **kw):
    rejected = []
    store = AuthStore(raw, SECRET)
    r = SlotReader(store, lambda i: f"q/{i}", clock=clock,
                   on_reject=lambda key, why: rejected.append(key), **kw)
    return store, r, rejected


def test_a_forged_head_is_not_consumed_and_the_genuine_value_overwriting_it_is_read():
    raw, clock = DictStore(), Clock()
    store, r, rejected = reader(raw, clock)
    raw.set("q/1", "junk")
    raw.set("q/2", "junk")
    for _ in range(3):
        assert r.take() is None and r.head_forged
    assert rejected == ["q/1"]                       # reported once
    store.set("q/1", "genuine 1")                    # the writer gets to index 1
    assert r.take() == ("q/1", b"genuine 1")
    assert r.take() is None and r.head_forged        # index 2: forged too, waited at
    store.set("q/2", "genuine 2")
    assert r.take() == ("q/2", b"genuine 2")


def test_a_hole_the_counter_handed_out_is_skipped_once_it_outlived_its_timeout():
    raw, clock = DictStore(), Clock()
    store, r, _ = reader(raw, clock, count_key="q/count", hole_timeout_s=2.0)
    raw.add("q/count", 1)                            # a forged bump: index 1 never written
    store.set(f"q/{raw.add('q/count', 1)}", "genuine 2")
    assert r.take() is None                          # a writer may be about to write 1
    clock.now = 1.0
    assert r.take() is None
    clock.now = 2.5
    assert r.take() == ("q/2", b"genuine 2")
    assert r.next_index == 3


def test_an_idle_queue_costs_one_check_per_look_and_a_counter_read_per_second():
    raw, clock = DictStore(), Clock()
    _, r, _ = reader(raw, clock, count_key="q/count", count_check_s=1.0)
    for i in range(100):
        clock.now = i * 0.02                         # the agent's loop: every 20 ms
        assert r.take() is None
    # 100 checks of the head, the counter read once per second of those two seconds
    assert raw.requests == 100 + 2


def test_forged_values_behind_a_hole_are_not_taken_for_genuine_ones():
    raw, clock = DictStore(), Clock()
    store, r, _ = reader(raw, clock, count_key="q/count", hole_timeout_s=0.0)
    raw.add("q/count", 5)
    for i in range(2, 6):
        raw.set(f"q/{i}", seal(b"x" * 64, f"q/{i}", "forged"))
    assert r.take() is None and r.next_index == 1


def test_only_distinct_genuine_ballots_count():
    raw = DictStore()
    raw.append = lambda key, value: raw.values.__setitem__(key, raw.values.get(key, b"") + value)
    store = AuthStore(raw, SECRET)
    for voter in ("w0", "w1", "w1"):                       # a ballot cast twice counts once
        store.cast_ballot("commit/0/5/ballots", voter)
    raw.append("commit/0/5/ballots", b"w2\n" + seal(b"x" * 64, "commit/0/5/ballots#w3", "w3")
               + b"\n")                                   # unsigned, and wrongly signed
    other = AuthStore(DictStore(), SECRET)
    other.raw.append = raw.append
    other.cast_ballot("commit/0/6/ballots", "w4")          # another step's ballot, copied
    raw.append("commit/0/5/ballots", raw.values["commit/0/6/ballots"])
    assert store.ballot_voters("commit/0/5/ballots") == {"w0", "w1"}


def test_a_host_ballot_counts_its_voters_only_as_signed_for_that_host_and_step():
    """Host ballots (``host:<node>:<voters>``) next to lines made to look like them: one
    signed for another host, one for another step, one with its names changed after
    signing, one with no ``:`` after the node, bytes that are no text, a truncated MAC."""
    raw = DictStore()
    raw.append = lambda key, value: raw.values.__setitem__(key, raw.values.get(key, b"") + value)
    store = AuthStore(raw, SECRET)
    key = "commit/3/9/ballots"
    store.cast_host_ballot(key, 0, ["w0", "w1"])
    store.cast_ballot(key, "w2")                                   # a voter's own ballot
    as_host1 = seal(SECRET, f"{key}#host:1", "host:2:w5,w6")       # signed for host 1
    other_step = seal(SECRET, "commit/3/8/ballots#host:3", "host:3:w7")
    changed = seal(SECRET, f"{key}#host:4", "host:4:w8").replace(b"w8", b"w9")
    no_colon = seal(SECRET, f"{key}#host:5w10", "host:5w10")
    junk = b"tm1:" + b"f" * 64 + b":host:6:\xff\xfe"
    short = seal(SECRET, f"{key}#host:7", "host:7:w11")[:40]
    for line in (as_host1, other_step, changed, no_colon, junk, short):
        raw.append(key, b"\n" + line + b"\n")
    store.cast_host_ballot(key, 8, ["w12"])
    assert store.ballot_voters(key) == {"w0", "w1", "w2", "w12"}
    assert store.ballot_tally(key, {0, 8}) == (4, {"w0", "w1", "w12"})


def test_a_host_ballot_and_its_count_in_one_write_and_a_forged_counter_repaired():
    """``cast_host_ballot_and_count`` on the built-in store: the ballot appended once and
    counted; a counter someone set to junk is replaced by the last count this client saw
    plus the host's voters, the ballot not cast twice."""
    from trainmover.core import kvserver, kvstore

    run_key = b"q" * 32
    srv = kvserver.serve(run_key)
    try:
        raw = kvstore.connect("127.0.0.1", srv.port, run_key, 10)
        store = AuthStore(raw, SECRET)
        key, votes = "commit/0/4/ballots", "commit/0/4/votes"
        assert store.cast_host_ballot_and_count(key, 0, ["w0", "w1"], votes) == 2
        raw.set(votes, b"junk")
        assert store.cast_host_ballot_and_count(key, 1, ["w2"], votes) == 3
        assert store.ballot_voters(key) == {"w0", "w1", "w2"}
        assert raw.get(key).count(b"host:1:") == 1
    finally:
        srv.close()


def test_junk_planted_before_the_vote_does_not_swallow_the_first_ballot():
    """Bytes with no newline of their own set at a step's ballots key before anyone votes
    (the attack test's replayed decision): the first ballot appended after them still
    counts. (It was glued to the junk's line, so the step waited for its voter's rare
    recheck, 10 s, to cast it again: found by the attack test's step times.)"""
    raw = DictStore()
    raw.append = lambda key, value: raw.values.__setitem__(key, raw.values.get(key, b"") + value)
    store = AuthStore(raw, SECRET)
    raw.values["commit/0/7/ballots"] = seal(SECRET, "commit/0/7/decision", "commit")
    for voter in ("w0", "w1"):
        store.cast_ballot("commit/0/7/ballots", voter)
    assert store.ballot_voters("commit/0/7/ballots") == {"w0", "w1"}


def test_a_leaders_ballot_names_its_members_voters_under_their_hosts_and_each_counts_once():
    """A vote group's leader (host 5) casts for itself and members 3 and 4; member 3, which
    left the group, casts its voters again on its own, and a late vote of host 4 comes in a
    ballot of its own: every voter counts once, and each host's voters are found under it."""
    raw = DictStore()
    raw.append = lambda key, value: raw.values.__setitem__(key, raw.values.get(key, b"") + value)
    store = AuthStore(raw, SECRET)
    key = "commit/1/2/ballots"
    store.cast_host_ballot(key, 5, ["w10", "w11"], {3: ["w6", "w7"], 4: ["w8"]})
    store.cast_host_ballot(key, 3, ["w6", "w7"])
    store.cast_host_ballot(key, 5, [], {4: ["w9"]})
    assert store.ballot_voters(key) == {"w6", "w7", "w8", "w9", "w10", "w11"}
    assert store.ballot_tally(key, {5}) == (6, {"w10", "w11"})
    assert store.ballot_tally(key, {3, 4}) == (6, {"w6", "w7", "w8", "w9"})
    with pytest.raises(ValueError, match="voter's name"):
        store.cast_host_ballot(key, 5, ["w1,w2"])


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_the_tally_counts_as_the_set_of_every_voter_does(data):
    """Random ballots of a job whose voters each live on one host (as process names do):
    hosts casting their voters in one or more ballots, through their group's leader or on
    their own, a voter cast more than once. The tally's count is the number of distinct
    voters named, and its voters of the asked hosts are exactly theirs."""
    hosts = data.draw(st.integers(1, 6))
    on = {f"w{i}": data.draw(st.integers(0, hosts - 1)) for i in range(data.draw(
        st.integers(1, 12)))}
    store = PlainStore(DictStore())
    store.raw.append = lambda key, value: store.raw.values.__setitem__(
        key, store.raw.values.get(key, b"") + value)
    key = "commit/0/0/ballots"
    for _ in range(data.draw(st.integers(1, 8))):
        caster = data.draw(st.integers(0, hosts - 1))
        cast = data.draw(st.lists(st.sampled_from(sorted(on)), max_size=6, unique=True))
        own = [v for v in cast if on[v] == caster]
        members = {}
        for v in cast:
            if on[v] != caster:
                members.setdefault(on[v], []).append(v)
        if own or members:
            store.cast_host_ballot(key, caster, own, members)
    if key not in store.raw.values:
        return
    named = store.ballot_voters(key)
    asked = set(data.draw(st.lists(st.integers(0, hosts - 1), max_size=3)))
    assert store.ballot_tally(key, asked) == (len(named), {v for v in named if on[v] in asked})
