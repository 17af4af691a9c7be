"""A step's commit vote under forged values (worker/liveness.py ``CommitVote``), on a real
store in this process: a forged decision and a forged count together must not stall it."""
import threading
import time

from trainmover.comm.groups import StoreClients, start_store_server
from trainmover.core import protocol as P
from trainmover.worker.liveness import CommitVote

SECRET = b"v" * 64


def test_a_forged_decision_and_a_forged_decrement_together_do_not_stall_the_vote():
    """Step 6's decision key holds an unsigned "abort" and its vote count was bumped down:
    the last voter arrives one short of the count, waits, and meets the forged value, which
    makes the store's ``wait`` return at once. It must still look at the ballots, find every
    voter's, and replace the forged value with the genuine "commit". (It used to poll the
    forged value for ever, and every worker of the job with it: found by the attack test.)"""
    server = start_store_server(timeout_s=20, run_key=SECRET)
    stores = StoreClients(server.address, timeout_s=20)
    raw = server.client()      # past the store's handshake, but signing nothing
    raw.set(P.commit_key(0, 6, "decision"), "abort")         # unsigned: nobody of the job's
    raw.add(P.commit_key(0, 6, "votes"), -1)
    stores.get().cast_ballot(P.commit_key(0, 6, "ballots"), "w0")   # the other voter's
    raw.add(P.commit_key(0, 6, "votes"), 1)
    result = []
    vote = threading.Thread(target=lambda: result.append(
        CommitVote(stores, num_voters=2, epoch=0, voter="w1")(6, {})), daemon=True)
    vote.start()
    vote.join(timeout=10)
    assert result == [True], "the vote did not end within 10 s"
    assert stores.get().valid(P.commit_key(0, 6, "decision")) == b"commit"


def test_junk_over_a_counter_is_repaired_and_the_vote_goes_on():
    """Text written over a step's vote counter: TCPStore's server dropped the connection of
    the next voter to add to it (the worker then died on its store); this store answers
    that the value is no number, and the voter's signed client puts back the count it saw
    last and counts on. The step commits on its ballots."""
    server = start_store_server(timeout_s=20, run_key=SECRET)
    stores = StoreClients(server.address, timeout_s=20)
    raw = server.client()
    rejected = []
    stores.on_reject = lambda key, exc: rejected.append(key)
    votes = P.commit_key(0, 7, "votes")
    raw.set(votes, "junk")
    results = []
    voters = [threading.Thread(target=lambda v=v: results.append(
        CommitVote(stores, num_voters=2, epoch=0, voter=v)(7, {})), daemon=True)
        for v in ("w0", "w1")]
    for t in voters:
        t.start()
    for t in voters:
        t.join(timeout=10)
    assert results == [True, True], "the vote did not end within 10 s"
    # each voter that met the junk says so (once per client)
    assert int(raw.get(votes)) == 2 and set(rejected) == {votes}


def test_ballots_overwritten_mid_vote_are_cast_again_and_the_step_commits():
    """The ballots key overwritten after one voter cast its ballot (and the counter with it):
    the voters waiting look at the ballots again, the one whose ballot is gone casts it
    again, and the step commits instead of waiting out the store's timeout."""
    server = start_store_server(timeout_s=20, run_key=SECRET)
    stores = StoreClients(server.address, timeout_s=20)
    raw = server.client()
    ballots, votes = P.commit_key(0, 8, "ballots"), P.commit_key(0, 8, "votes")
    results = []
    first = threading.Thread(target=lambda: results.append(
        CommitVote(stores, num_voters=2, epoch=0, voter="w0")(8, {})), daemon=True)
    first.start()
    wait = time.monotonic() + 10
    while not raw.check([ballots]) and time.monotonic() < wait:
        time.sleep(0.01)
    raw.set(ballots, "junk")             # w0's ballot erased
    raw.set(votes, "0")                  # and its count
    second = threading.Thread(target=lambda: results.append(
        CommitVote(stores, num_voters=2, epoch=0, voter="w1")(8, {})), daemon=True)
    second.start()
    for t in (first, second):
        t.join(timeout=15)
    assert results == [True, True], "the vote did not end within 15 s"
    assert stores.get().ballot_voters(ballots) == {"w0", "w1"}


def test_a_counter_reset_under_every_voter_costs_a_second_not_the_slow_recheck():
    """The vote counter set back to 0 before each voter adds (the attack test's "commit
    votes" family, written over for a fraction of a second): every voter draws count 1, so
    nobody is at or one short of the count. The step's reporter still looks at the ballots
    every ``BALLOT_RECHECK_S`` and decides; before, every voter waited the rare recheck
    (``BALLOT_RECHECK_ALL_S``, 10 s), a 10 s stall per attacked step."""
    from trainmover.worker import liveness

    server = start_store_server(timeout_s=30, run_key=SECRET)
    raw = server.client()
    votes = P.commit_key(0, 9, "votes")
    results, voters = [], []
    for name in ("w0", "w1", "w2", "w3"):
        raw.set(votes, "0")
        # a client each, as voters in their own processes (a shared one would serialize
        # a voter's add behind another's blocking wait)
        vote = CommitVote(StoreClients(server.address, timeout_s=30), num_voters=4, epoch=0,
                          voter=name,
                          reporter="w0" if name == "w0" else None)
        voters.append(threading.Thread(target=lambda v=vote: results.append(v(9, {})),
                                       daemon=True))
        voters[-1].start()
        wait = time.monotonic() + 10
        while raw.get(votes) != b"1" and time.monotonic() < wait:
            time.sleep(0.005)
        assert raw.get(votes) == b"1", name
    last = time.monotonic()
    for t in voters:
        t.join(timeout=liveness.BALLOT_RECHECK_ALL_S / 2)
    assert results == [True] * 4, (f"the vote did not end within "
                                   f"{time.monotonic() - last:.1f} s")
