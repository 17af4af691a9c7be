"""The commit vote aggregated per group of hosts, so that the job's store serves a few
requests a group a step instead of three a host.

Why: the store serves every request in one thread, ~14 us each: with every host's agent
casting its ballot there and waiting for the decision, a step's vote took ~85 ms at 2,048
hosts and grew with the hosts (``benchmarks/vote_hosts.py``). Here the hosts are cut into
groups of ``agent.vote_group_hosts`` consecutive nodes (about sqrt(hosts) by default from
``VOTE_GROUPS_FROM_HOSTS`` hosts). A group's last host is its leader (host 0, which serves
the job's store, leads none but a group of one); its agent serves a small store of its
own (``GroupServer``, the built-in store with the run's handshake) whose address it
publishes, signed, at ``agent/<leader>/votes``. Members' relays (``agent/votes.py``) cast
their ballots there (an append that waits for no answer) and wait there for the decision
as they would at the job's store; the leader's relay takes
each member's ballot as it is appended (checked: signed for that host, that step's key)
as if the member were one of its own processes, casts one ballot for the group at the
job's store, waits for the decision there, and writes it, as sealed there, into the
group's store, where the members' waits wake.

What keeps every guarantee: the decision is still taken at the job's store alone, from
ballots that name every voter (a leader's line names its members' voters under their
hosts, and a host found in two lines has its voters counted once: ``core/ballots.py``; so
a ballot cast twice, through the group and again at the job's store, is no double vote,
and a count too high only makes a relay look at the ballots early). A member
leaves its group, for good, as soon as the leader's store closes, the leader is declared
lost (``agent/<leader>/fenced``), or a request to it is not answered within
``agent.vote_group_timeout_s``: it then casts every ballot of its pending steps again at the
job's store and waits there, as a host of no group. While it waits on its group, it also
reads the decision at the job's store every ``votes.GROUP_LOOK_ROOT_S`` (a leader that
stopped relaying).
"""
from __future__ import annotations

import collections
import queue
import threading

from trainmover.agent.feeds import await_genuine
from trainmover.core import kvserver, kvstore
from trainmover.core import protocol as P
from trainmover.core.auth import AuthStore, host_ballots
from trainmover.core.kvstore import Op, StoreError

# The leader deletes a step's keys from its group's store once this many later steps were
# decided (a late vote is answered by the relay's memory of decided steps, not the store).
GROUP_STEPS_KEPT = 64
_BALLOTS_SUFFIX = b"/ballots"


def group_of(node: int, nnodes: int, size: int) -> range:
    """The nodes of ``node``'s vote group (``size`` consecutive nodes; the last group may
    be smaller)."""
    first = node - node % size
    return range(first, min(first + size, nnodes))


def leader_of(node: int, nnodes: int, size: int) -> int:
    """The leader of ``node``'s group: its last node (host 0 serves the job's store and
    the controller already)."""
    return group_of(node, nnodes, size)[-1]


def _step_of(key: bytes) -> tuple[int, int] | None:
    """(epoch, step) of a ``commit/<epoch>/<step>/ballots`` key, else None."""
    if not key.startswith(b"commit/") or not key.endswith(_BALLOTS_SUFFIX):
        return None
    parts = key[len(b"commit/"):-len(_BALLOTS_SUFFIX)].split(b"/")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        return None
    return int(parts[0]), int(parts[1])


class GroupServer(kvserver.KVServer):
    """The built-in store, handing each value appended at a step's ballots key to
    ``on_append(key, value)`` from its thread (which must not block on this store)."""

    on_append = None

    def _handle(self, stream, op, timeout_ms, number, fields):
        answer = super()._handle(stream, op, timeout_ms, number, fields)
        if op == Op.APPEND and self.on_append is not None:
            self.on_append(fields[0], fields[1])
        return answer


class GroupLeader:
    """A leader's side: serves the group's store, hands its members' ballots to the host's
    relay (``VoteRelay.relay_host``) and writes each decision the relay hands back
    (``decided``) into the group's store."""

    def __init__(self, run_key: bytes, address: str, node: int, members: range, relay,
                 limits: kvstore.StoreLimits, timeout_s: float):
        self.node, self.relay, self._secret = node, relay, run_key
        self.members = frozenset(members) - {node}
        self.error: BaseException | None = None
        self.server = GroupServer.listen(kvstore.store_key(run_key), address, 0, limits)
        self.address = f"{address}:{self.server.port}"
        self._client = AuthStore(kvstore.connect(address, self.server.port, run_key,
                                                 timeout_s), run_key)
        self._late: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._told: collections.OrderedDict = collections.OrderedDict()
        self.server.on_append = self._appended
        threading.Thread(target=self._loop, name="vote-group", daemon=True).start()

    def _appended(self, key: bytes, value: bytes) -> None:
        step = _step_of(key)
        if step is None:
            return
        for node, names in host_ballots(self._secret, key.decode(), value):
            if node in self.members and names:
                self.relay.relay_host(node, step, names, self)

    def decided(self, key: tuple[int, int], value: bytes) -> None:
        """Step ``key``'s decision into the group's store, where the members' waits wake
        (from the relay's waiter: written at once, a thread handoff less on every step's
        path)."""
        try:
            with self._lock:
                if key in self._told:
                    return                   # told already (a member's vote came late)
                self._client.set(P.commit_key(*key, "decision"), value)
                self._told[key] = None
                if len(self._told) > GROUP_STEPS_KEPT:
                    old, _ = self._told.popitem(last=False)
                    self._client.delete_keys([P.commit_key(*old, what)
                                              for what in ("ballots", "votes", "decision")])
        except (OSError, StoreError) as exc:     # its own store's thread failed
            self.error = exc
            # its members would wait for decisions that never come there: closed, they
            # leave the group and vote at the job's store
            self.server.close()

    def late(self, key: tuple[int, int], value: bytes) -> None:
        """``decided``, for a member's ballot on a step decided already: from the store's
        own thread, which must not wait on its store, so written from another."""
        self._late.put((key, value))

    def _loop(self) -> None:
        while True:
            self.decided(*self._late.get())

    def close(self) -> None:
        self.server.close()


class GroupLink:
    """A member's side: finds its leader's store (the address at ``agent/<leader>/votes``,
    waited for on a thread), holds two connections to it (``forward``, ``wait``: the relay's
    two threads), and calls ``on_lost(why)`` once, when the leader is gone. ``ready()``:
    connected, not lost."""

    def __init__(self, run_key: bytes, leader: int, root_store, timeout_s: float, on_lost):
        self.leader, self._run_key, self._timeout_s = leader, run_key, timeout_s
        self._root, self._on_lost = root_store, on_lost
        self.forward: AuthStore | None = None
        self.wait: AuthStore | None = None
        self.lost: str | None = None
        self._lock = threading.Lock()
        threading.Thread(target=self._run, name=f"vote-group-{leader}", daemon=True).start()

    def ready(self) -> bool:
        return self.wait is not None and self.lost is None

    def _run(self) -> None:
        store = self._root
        try:
            address = await_genuine(store, P.agent_key(self.leader, "votes"))
            host, _, port = address.decode().rpartition(":")
            clients = [kvstore.connect(host, int(port), self._run_key, self._timeout_s)
                       for _ in range(2)]
            for c in clients:
                c.answer_margin_s = 0.0     # vote_group_timeout_s bounds each request
            with self._lock:
                if self.lost is None:
                    self.forward, self.wait = (AuthStore(c, self._run_key) for c in clients)
            await_genuine(store, P.agent_key(self.leader, "fenced"))
            self.lose(f"its leader, host {self.leader}, was declared lost")
        except (OSError, StoreError, ValueError) as exc:
            self.lose(f"its leader's store, host {self.leader}: {exc}")

    def lose(self, why: str) -> None:
        """Leave the group for good (``on_lost`` once; a request blocked on the leader's
        store raises at once)."""
        with self._lock:
            if self.lost is not None:
                return
            self.lost = why
            clients = [c for c in (self.forward, self.wait) if c is not None]
        for client in clients:
            abort = getattr(client.raw, "abort", None)
            if abort is not None:
                abort()
        self._on_lost(why)
