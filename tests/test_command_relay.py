"""The controller's commands relayed by the host's agent (``agent/commands.py``) to its
processes' ``Inbox`` and ``CommandChannel``: on a real store in this process, the
processes' channels real socket pairs."""
import queue
import socket
import time
from types import SimpleNamespace

import pytest

from trainmover.agent import commands as relay_mod
from trainmover.agent.commands import CommandRelay
from trainmover.comm.groups import StoreClients, start_store_server
from trainmover.core import protocol as P
from trainmover.core.auth import AuthStore
from trainmover.worker.liveness import Inbox
from trainmover.worker.commands import CommandChannel

SECRET = b"c" * 64


class Host:
    """An agent's side: its processes by name, delivering as ``Agent.deliver`` does."""

    def __init__(self, server):
        self.children: dict[str, SimpleNamespace] = {}
        self.rejected: list[tuple[str, str]] = []
        self.relay = CommandRelay(AuthStore(server.client(), SECRET), 0, self.deliver,
                                  lambda key, why: self.rejected.append((key, why)))

    def deliver(self, name, message):
        child = self.children.get(name)
        if child is None:
            return "unknown"
        if child.gone:
            return "gone"
        try:
            child.channel.send(message)
            return "sent"
        except BlockingIOError:
            return "later"


@pytest.fixture
def host():
    server = start_store_server(timeout_s=20, run_key=SECRET)
    stores = StoreClients(server.address, timeout_s=20)
    agent = Host(server)

    def start(name, read=True):
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        mine.setblocking(False)
        proc = SimpleNamespace(name=name, channel=mine, gone=False, theirs=theirs)
        if read:
            proc.commands = CommandChannel(stores, Inbox(theirs, stores), name)
        agent.children[name] = proc
        return proc

    yield SimpleNamespace(server=server, stores=stores, agent=agent, start=start)
    server.close()


def send(stores, index, *items, node=0):
    """The controller's message ``index`` to the host: ``(process, command)`` pairs."""
    stores.get().set(P.host_command_key(node, index), P.write_message(P.HostCommands(
        [[name, P.encode_command(cmd)] for name, cmd in items])))


def take(proc, n, timeout_s=10):
    out = []
    deadline = time.monotonic() + timeout_s
    while len(out) < n and time.monotonic() < deadline:
        try:
            out.append(proc.commands.queue.get(timeout=0.05))
        except queue.Empty:
            pass
    return out


@pytest.mark.timeout(60)
def test_each_process_gets_its_commands_in_order_and_the_messages_are_deleted(host):
    w0, w1 = host.start("w0"), host.start("w1")
    send(host.stores, 1, ("w0", P.Stop(1)), ("w1", P.Stop(2)), ("w0", P.Stop(3)))
    send(host.stores, 2, ("w0", P.Stop(4)))
    assert [c.stop_id for c in take(w0, 3)] == [1, 3, 4]
    assert [c.stop_id for c in take(w1, 1)] == [2]
    raw = host.server.client()
    deadline = time.monotonic() + 10
    while raw.check([P.host_command_key(0, 2)]) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not raw.check([P.host_command_key(0, 1)]) and not raw.check(
        [P.host_command_key(0, 2)])
    assert host.agent.rejected == []


@pytest.mark.timeout(60)
def test_forged_messages_are_waited_past_and_an_undefined_command_is_dropped(host):
    """Junk at the head (someone past the store's handshake, signing nothing) is not
    consumed: the controller's message written over it is delivered. A genuine message
    holding a command the protocol does not define delivers the others, never that one."""
    w0 = host.start("w0")
    raw = host.server.client()
    raw.set(P.host_command_key(0, 1), P.write_message(P.HostCommands(
        [["w0", P.encode_command(P.Stop(66))]])))              # unsigned: forged
    time.sleep(0.3)
    assert take(w0, 1, timeout_s=0.2) == []
    send(host.stores, 1, ("w0", P.Stop(1)))
    assert [c.stop_id for c in take(w0, 1)] == [1]
    host.stores.get().set(P.host_command_key(0, 2), P.write_message(P.HostCommands(
        [["w0", '{"type": "shell", "argv": ["rm"]}'], ["w0", P.encode_command(P.Stop(2))]])))
    assert [c.stop_id for c in take(w0, 1)] == [2]
    assert take(w0, 1, timeout_s=0.3) == []
    assert any("unknown command type 'shell'" in why for _, why in host.agent.rejected)
    host.stores.get().set(P.host_command_key(0, 3), b'{"commands": [["W0!", "x"]]}')
    send(host.stores, 4, ("w0", P.Stop(4)))
    assert [c.stop_id for c in take(w0, 1)] == [4]
    assert any("is not [process name, command]" in why for _, why in host.agent.rejected)


@pytest.mark.timeout(60)
def test_a_command_waits_for_its_process_to_start_and_for_room_on_its_channel(host):
    """A standby's assignment read before the agent started it is held until it is; a
    process whose channel is full (stopped) gets its commands, in order, once it reads."""
    send(host.stores, 1, ("s0", P.Stop(1)))
    time.sleep(0.3)
    s0 = host.start("s0")
    assert [c.stop_id for c in take(s0, 1)] == [1]
    w0 = host.start("w0", read=False)
    while True:
        try:
            w0.channel.send(P.CHANNEL_BEAT)       # the channel filled with what it ignores
        except BlockingIOError:
            break
    send(host.stores, 2, ("w0", P.Stop(2)), ("w0", P.Stop(3)), ("s0", P.Stop(4)))
    assert [c.stop_id for c in take(s0, 1)] == [4]   # another process is not held up
    time.sleep(0.3)
    w0.commands = CommandChannel(host.stores, Inbox(w0.theirs, host.stores), "w0")
    assert [c.stop_id for c in take(w0, 2)] == [2, 3]


@pytest.mark.timeout(60)
def test_a_gone_process_drops_its_commands_and_an_unstarted_one_times_out(host, monkeypatch):
    monkeypatch.setattr(relay_mod, "HOLD_S", 0.3)
    w0, w1 = host.start("w0"), host.start("w1")
    w0.gone = True
    send(host.stores, 1, ("w0", P.Stop(1)), ("w9", P.Stop(2)), ("w1", P.Stop(3)))
    assert [c.stop_id for c in take(w1, 1)] == [3]
    deadline = time.monotonic() + 10
    while not host.agent.rejected and time.monotonic() < deadline:
        time.sleep(0.05)
    assert host.agent.rejected and host.agent.rejected[0][0] == "w9"
    assert "to start and was dropped" in host.agent.rejected[0][1]
    assert take(w0, 1, timeout_s=0.2) == []
    assert host.agent.relay._pending == {}
