"""The controller's outbox (``Coordinator._flush``): what a round decided reaches the store
in requests of up to ``SET_BATCH`` keys, in order, with the hosts' requests in their place."""
import os

import pytest

from trainmover.comm.groups import start_store_server
from trainmover.control.coordinator import SET_BATCH, Coordinator
from trainmover.core import decisions as C
from trainmover.core.auth import AuthStore
from trainmover.core.events import EventLog

from test_failures import job

KEY = b"k" * 32


class Counting:
    """A store client that counts the keys of each write request."""

    def __init__(self, raw):
        self.raw, self.requests = raw, []

    def __getattr__(self, name):
        return getattr(self.raw, name)

    def set(self, key, value):
        self.requests.append(1)
        self.raw.set(key, value)

    def multi_set(self, keys, values):
        self.requests.append(len(keys))
        self.raw.multi_set(keys, values)


@pytest.mark.timeout(60)
def test_the_outbox_goes_in_batches_in_order(tmp_path):
    server = start_store_server(timeout_s=10, run_key=KEY)
    try:
        run_dir = str(tmp_path / "run")
        os.makedirs(run_dir, mode=0o700)
        co = Coordinator(job(), run_dir, quiet=True)
        co._run_key = KEY
        co.ctx.membership = C.Membership.initial(co.cfg.layout, ["w0", "w1", "w2", "w3"],
                                                 ["s0"])
        counting = Counting(server.client())
        co.ctx.store = AuthStore(counting, KEY)
        co.ctx.events = EventLog(os.path.join(run_dir, "events.jsonl"), worker="coordinator")
        sent = []
        co.ctx.procs.send = lambda node, request: sent.append(
            (node, request, co.ctx.store.valid("k/1099")))
        n = SET_BATCH + 1100
        co.ctx.outbox = [("set", f"k/{i}", f"v{i}") for i in range(1100)]
        co.ctx.outbox += [("agent", 3, "spawn"), ("set", "k/5", "again")]
        co.ctx.outbox += [("set", f"k/{i}", f"v{i}") for i in range(1100, n)]
        co._flush(force=True)
        assert co.ctx.outbox == []
        # the snapshot (one set); 1,100 keys as 1,024 + 76; after the host's request the
        # 1 + 1,024 others as 1,024 + 1
        assert counting.requests == [1, SET_BATCH, 1100 - SET_BATCH, SET_BATCH, 1]
        # the host's request went after the keys before it and before those after it
        assert sent == [(3, "spawn", b"v1099")]
        assert co.ctx.store.valid("k/5") == b"again"
        assert [co.ctx.store.valid(f"k/{i}") for i in (0, 1100, n - 1)] == \
            [b"v0", b"v1100", f"v{n - 1}".encode()]
    finally:
        server.close()
