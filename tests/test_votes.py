"""A step's commit vote under forged values (worker/liveness.py ``CommitVote``), on a real
store in this process: a forged decision and a forged count together must not stall it."""
import threading
from datetime import timedelta

import torch.distributed as dist

from trainmover.comm.groups import StoreAddress, StoreClients, start_store_server
from trainmover.core import protocol as P
from trainmover.worker.liveness import CommitVote

SECRET = b"v" * 64


def test_a_forged_decision_and_a_forged_decrement_together_do_not_stall_the_vote():
    """Step 6's decision key holds an unsigned "abort" and its vote count was bumped down:
    the last voter arrives one short of the count, waits, and meets the forged value, which
    makes the store's ``wait`` return at once. It must still look at the ballots, find every
    voter's, and replace the forged value with the genuine "commit". (It used to poll the
    forged value for ever, and every worker of the job with it: found by the attack test.)"""
    server = start_store_server()
    stores = StoreClients(StoreAddress("127.0.0.1", server.port), timeout_s=20, secret=SECRET)
    raw = dist.TCPStore("127.0.0.1", server.port, is_master=False,
                        timeout=timedelta(seconds=20))
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
