"""The controller's outbox (``control/saving.py``, through ``Coordinator._flush``): what a
round decided reaches the store in requests of up to ``SET_BATCH`` keys, in order, with the
hosts' requests in their place."""
import os

import pytest

from trainmover.comm.groups import start_store_server
from trainmover.control.coordinator import Coordinator
from trainmover.control.saving import SET_BATCH
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


def coordinator(tmp_path, server):
    """A controller of a 4-worker job on ``server``, its writes counted."""
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir, mode=0o700)
    co = Coordinator(job(), run_dir, quiet=True)
    co._run_key = KEY
    co.ctx.membership = C.Membership.initial(co.cfg.layout, ["w0", "w1", "w2", "w3"], ["s0"])
    counting = Counting(server.client())
    co.ctx.store = AuthStore(counting, KEY)
    co.ctx.events = EventLog(os.path.join(run_dir, "events.jsonl"), worker="coordinator")
    return co, counting


@pytest.mark.timeout(60)
def test_the_outbox_goes_in_batches_in_order(tmp_path):
    server = start_store_server(timeout_s=10, run_key=KEY)
    try:
        co, counting = coordinator(tmp_path, server)
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


@pytest.mark.timeout(60)
def test_the_rounds_commands_go_last_as_one_message_a_host(tmp_path):
    """Commands to processes of two hosts, interleaved with keys: after the keys, one
    ``HostCommands`` a host holding its processes' commands in the order sent, numbered
    from the host's counter; the same outbox sent again (a resumed controller) writes the
    same messages at the same numbers."""
    from trainmover.core import protocol as P

    server = start_store_server(timeout_s=10, run_key=KEY)
    try:
        co, counting = coordinator(tmp_path, server)
        co.ctx.hosts.update({"w0": 0, "w1": 1, "w2": 0, "s0": 1})
        co.ctx.cmd_next = {"1": 4}
        co.ctx.send("w0", P.Stop(1))
        co.ctx.put("k/a", "1")
        co.ctx.send("w1", P.Stop(2))
        co.ctx.send("w2", P.Stop(3))
        co.ctx.send("w0", P.Stop(4))
        co.ctx.send("s0", P.Stop(5))
        outbox = list(co.ctx.outbox)
        co._flush(force=True)
        assert counting.requests == [1, 3]            # the snapshot; the key and two hosts
        assert co.ctx.cmd_next == {"0": 2, "1": 5}

        def read(node, index):
            raw = co.ctx.store.valid(P.host_command_key(node, index))
            return [(name, P.decode_command(c).stop_id)
                    for name, c in P.read_message(P.HostCommands, raw).commands]

        assert read(0, 1) == [("w0", 1), ("w2", 3), ("w0", 4)]
        assert read(1, 4) == [("w1", 2), ("s0", 5)]
        # resumed from the snapshot taken before the send: the same outbox, the same numbers
        for node in (0, 1):
            server.client().delete_key(P.host_command_key(node, {0: 1, 1: 4}[node]))
        co.ctx.cmd_next, co.ctx.outbox = {"1": 4}, outbox
        co._flush(force=True)
        assert read(0, 1) == [("w0", 1), ("w2", 3), ("w0", 4)]
        assert read(1, 4) == [("w1", 2), ("s0", 5)]
    finally:
        server.close()


@pytest.mark.timeout(60)
def test_a_hosts_commands_past_a_messages_size_go_in_several_in_order(tmp_path):
    from trainmover.core import protocol as P

    server = start_store_server(timeout_s=10, run_key=KEY)
    try:
        co, _ = coordinator(tmp_path, server)
        co.ctx.hosts["w0"] = 0
        for i in range(12000):              # ~40 bytes each: more than one message holds
            co.ctx.send("w0", P.Stop(i))
        co._flush(force=True)
        got, index = [], 1
        while True:
            raw = co.ctx.store.valid(P.host_command_key(0, index))
            if raw is None:
                break
            assert len(raw) <= P.MAX_MESSAGE_BYTES
            got += [P.decode_command(c).stop_id
                    for _, c in P.read_message(P.HostCommands, raw).commands]
            index += 1
        assert index > 2 and got == list(range(12000))
    finally:
        server.close()
