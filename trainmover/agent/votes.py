"""The host's agent as the relay of its processes' commit votes, and the reader of their
channels (beats, votes, asks for an epoch's abort: ``agent/aborts.py``).

Why: with every worker voting in the job's one store, a step cost that store about four
requests a worker: 64K a step at 16K workers, most of its capacity at one step a second
(``trainmover bench control``). Here each worker votes on its own channel to its agent
(``worker/liveness.HostVote``); the agent casts one ballot for the host (the voters it
relays, one signed line) and adds their count to the step's vote counter; whoever's add
reaches the job's voter count checks the ballots and writes ``commit`` with a
compare-and-set, as the last voter did; each agent waits for the decision in the store and
relays it to its voters. The store sees three requests a host a step (the ballot and the
count in one write, a ``get`` that waits for the decision), and the decision is still one
compare-and-set, the controller's ``abort`` its rival, as before. Those requests, served
one after another by the store's one thread, are what a step's vote costs at scale: ~85 ms
at 2,048 hosts (``benchmarks/vote_hosts.py``).

When a host's ballot goes: as soon as every running worker of the host (started as one, or
a standby that has voted since) has voted on this step, else ``coalesce_s`` after the step's
first vote here (a worker that stopped voting: a leaver past its switch, until it exits).
Votes that come after its host's ballot went go in one more ballot ``coalesce_s`` after
the last one went, or at once with the last of them. The decision never depends on the
batching: it is taken when the ballots hold every voter.

In a job of many hosts the agents vote through vote groups (``agent/groupvote.py``): a
member host's relay casts its ballot into its group leader's store and waits there; the
leader's relay takes each member host's ballot as one of its own processes' votes (and
waits for it as for them), casts one ballot for the group, and hands the decision back.

Threads: the reader (every channel: beats counted, votes handed on), the forwarder (casts
ballots, decides) and the waiter (waits for each decision, relays it). The last two have a
store client each: the waiter's blocking waits would hold the forwarder's requests.
"""
from __future__ import annotations

import collections
import errno
import os
import queue
import select
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

from trainmover.core import protocol as P
from trainmover.core.auth import AuthError
from trainmover.core.kvstore import StoreError, StoreTimeout

# How often a relay waiting for a decision looks at the ballots itself (a forged or
# overwritten counter can leave nobody at the count): the relay that may have been the
# last to add, often; the others rarely (every host reading every host's ballot line each
# second of a slow step would be O(hosts^2) through the store). As ``worker/liveness``.
RECHECK_S = 1.0
RECHECK_ALL_S = 10.0
# Even the others' rare look was O(hosts^2) through the store on every step longer than
# RECHECK_ALL_S (at 2,048 simulated hosts it kept the first step from ever committing):
# a relay that is not the last to add reads only the count at its re-check, and the
# ballots when the count is complete with no decision (ballots erased: its own line may
# be gone), when it is one of the step's RECHECK_DEPUTIES (a count pushed down: they
# decide from the ballots), or once every RECHECK_ALL_S x hosts / RECHECK_FULL_HOSTS
# (both at once). Up to RECHECK_FULL_HOSTS hosts every relay reads them as before.
RECHECK_DEPUTIES = 2
RECHECK_FULL_HOSTS = 100
FORGED_POLL_S = 0.05
DECISIONS_KEPT = 64          # decided steps remembered for a vote that comes late
HOST_PROXY = "host:"         # a member host of this leader's vote group, in ``_last``
# A member waiting on its vote group reads the decision at the job's store this often (one
# request a waiting member host each time: only steps slower than this pay it).
GROUP_LOOK_ROOT_S = 2.0


class Channels:
    """Reads every message the agent's processes send on their channels: beats are
    counted on the process's record (``Child.beats``), votes handed to ``on_vote``, asks
    for an epoch's abort to ``on_watch`` (``agent/aborts.py``), step measurements to
    ``on_perf`` (``agent/perfs.py``), failure reports to ``on_report`` and notes of a
    recovery done to ``on_recovered`` (``agent/reports.py``). The channels are closed
    here (``remove``), never under this thread's ``select``."""

    def __init__(self, on_vote, on_watch=None, on_perf=None, on_report=None,
                 on_recovered=None):
        self.on_vote, self.on_watch, self.on_perf = on_vote, on_watch, on_perf
        self.on_report, self.on_recovered = on_report, on_recovered
        self._lock = threading.Lock()
        self._open: dict[int, object] = {}          # descriptor -> the process's record
        self._closing: list = []
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        threading.Thread(target=self._loop, name="channels", daemon=True).start()

    def add(self, child) -> None:
        with self._lock:
            self._open[child.channel.fileno()] = child
        self._wake()

    def remove(self, child) -> None:
        """The process exited: its channel is read no more and closed."""
        with self._lock:
            if child.channel is not None:
                self._open.pop(child.channel.fileno(), None)
                self._closing.append(child.channel)
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"!")
        except BlockingIOError:
            pass

    def _loop(self) -> None:
        while True:
            with self._lock:
                for channel in self._closing:
                    channel.close()
                self._closing.clear()
                open_ = dict(self._open)
            # poll, not select: on host 0, whose agent serves the store, descriptors pass
            # select's limit of 1024 with a few hundred workers
            poller = select.poll()
            for fd in [*open_, self._wake_r]:
                poller.register(fd, select.POLLIN)
            for fd, _ in poller.poll(1000):
                if fd == self._wake_r:
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
                else:
                    self._drain(fd, open_[fd])

    def _drain(self, fd: int, child) -> None:
        while True:
            try:
                raw = child.channel.recv(P.CHANNEL_MAX)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                raw = b""
            if not raw:                     # its end closed: it exited; read no more
                with self._lock:
                    self._open.pop(fd, None)
                return
            if raw == P.CHANNEL_BEAT:
                child.beat_at = time.monotonic()
                child.beats += 1
                continue
            got = P.read_channel_message(raw)
            if got is not None and got[0] == "v":
                self.on_vote(child, got[1], got[2], got[3])
                continue
            epoch = P.read_watch_message(raw)
            if epoch is not None:
                if self.on_watch is not None:
                    self.on_watch(child, epoch)
                continue
            perf = P.read_perf_message(raw)
            if perf is not None:
                if self.on_perf is not None:
                    self.on_perf(child, perf)
                continue
            report = P.read_report_message(raw)
            if report is not None:
                if self.on_report is not None:
                    self.on_report(child, *report)
                continue
            recovery_id = P.read_recovered_message(raw)
            if recovery_id is not None and self.on_recovered is not None:
                self.on_recovered(child, recovery_id)


@dataclass
class _Step:
    """One step's votes on this host."""

    first_at: float
    voters: dict = field(default_factory=dict)     # voter -> its process's record
    sent: set = field(default_factory=set)         # voters whose ballot went
    count: int = 0                                 # the counter after this host's last add
    arrived: int = 0                               # entries of the relay's ``_last`` at it
    cast_at: float = 0.0                           # when its last ballot went
    waited: bool = False                           # handed to the waiter
    # cast in the host's vote group (agent/groupvote.py), not at the job's store; None:
    # not cast yet
    via_group: bool | None = None
    member_of: dict = field(default_factory=dict)  # a leader's: member's voter -> its node


class VoteRelay:
    """``hosts``: the relays that cast at the job's store (the vote groups, where there are
    groups), this one the ``root_index``-th of them. A member of a vote group has its
    ``group`` set by its agent (a ``groupvote.GroupLink``); a leader's ``GroupLeader`` hands
    its members' ballots in (``relay_host``)."""

    def __init__(self, forward_store, wait_store, node: int, num_voters: int,
                 coalesce_s: float, hosts: int = 1, root_index: int | None = None):
        self.forward_store, self.wait_store = forward_store, wait_store
        self.node, self.num_voters, self.coalesce_s = node, num_voters, coalesce_s
        self.hosts = max(1, hosts)
        self.root_index = node if root_index is None else root_index
        self.group = None             # agent/groupvote.GroupLink: this host is a member
        self.error: BaseException | None = None     # the store is gone
        self._cv = threading.Condition()
        self._steps: dict[tuple[int, int], _Step] = {}
        self._last: dict[str, tuple[int, int]] = {}     # process -> its last vote's step
        self._decided: collections.OrderedDict = collections.OrderedDict()
        self._waits: queue.Queue = queue.Queue()
        self.on_decided = None       # called with each step's (key, decision) once known
        self.on_left_group = None    # called with why, when a member leaves its vote group
        threading.Thread(target=self._run, args=(self._forward,), name="vote-forwarder",
                         daemon=True).start()
        threading.Thread(target=self._run, args=(self._wait,), name="vote-waiter",
                         daemon=True).start()

    # --- from the channels' reader ----------------------------------------------------------
    def vote(self, child, epoch: int, step: int, voter: str) -> None:
        key = (epoch, step)
        with self._cv:
            decided = self._decided.get(key)
            if decided is None:
                st, created = self._step(key)
                unsent = len(st.voters) - len(st.sent)
                st.voters[voter] = child
                self._arrive(child.name, key)
                self._wake_if(created, st, unsent)
                return
        _tell(child, key, decided)           # a late vote on a decided step

    def expect(self, name: str) -> None:
        """A worker started here (not a standby): its vote is waited for from the first
        step on, as if it had voted before."""
        with self._cv:
            self._last.setdefault(name, (-1, -1))

    def forget(self, name: str) -> None:
        """The process exited: no vote of it is expected any more."""
        with self._cv:
            self._drop(name)
            self._cv.notify()

    # --- vote groups (agent/groupvote.py) -------------------------------------------------------
    def relay_host(self, node: int, key: tuple[int, int], names: list[str], group) -> None:
        """A leader's: member host ``node``'s ballot for step ``key``, cast in the group's
        store (``group``: the ``GroupLeader`` that hands the decision back). The member is
        waited for on the next steps as one of this host's processes is, until a step is
        decided without it (its processes exited)."""
        with self._cv:
            decided = self._decided.get(key)
            if decided is None:
                st, created = self._step(key)
                unsent = len(st.voters) - len(st.sent)
                for name in names:
                    st.voters.setdefault(name, group)
                    st.member_of[name] = node
                self._arrive(f"{HOST_PROXY}{node}", key)
                self._wake_if(created, st, unsent)
                return
        group.late(key, decided)               # a late ballot on a decided step

    def leave_group(self, why: str) -> None:
        """A member's: its leader is gone. Every step cast in the group is cast again at the
        job's store (its voters' names count once there) and waited for there."""
        with self._cv:
            if self.group is None:
                return
            self.group = None
            for st in self._steps.values():
                if st.via_group:
                    st.via_group, st.count, st.first_at = False, 0, 0.0
                    st.sent.clear()
            self._cv.notify()
        if self.on_left_group is not None:
            self.on_left_group(why)

    # --- who has voted where (under the lock) -------------------------------------------------
    # ``_last``: each process (and a leader's member host) -> the step it last voted on;
    # each pending step counts the entries at it (``arrived``), so whether all are there is
    # one comparison, not a pass over the host's processes (a leader's: its members) at
    # every vote
    def _step(self, key: tuple[int, int]) -> tuple[_Step, bool]:
        st = self._steps.get(key)
        if st is not None:
            return st, False
        st = self._steps[key] = _Step(time.monotonic())
        return st, True

    def _arrive(self, name: str, key: tuple[int, int]) -> None:
        old = self._last.get(name)
        if old == key:
            return
        self._drop(name)
        self._last[name] = key
        self._steps[key].arrived += 1

    def _drop(self, name: str) -> None:
        old = self._last.pop(name, None)
        st = self._steps.get(old) if old is not None else None
        if st is not None:
            st.arrived -= 1

    def _wake_if(self, created: bool, st: _Step, unsent: int) -> None:
        """The forwarder, where a vote changed what it does: a new step (a coalescing
        deadline), one whose every process has voted, or the first vote held after the
        host's last ballot for the step went (a deadline the forwarder does not sleep to
        yet). ``unsent``: the step's voters not in a ballot before this vote."""
        if created or (st.sent and not unsent) or self._ready(st, time.monotonic()):
            self._cv.notify()

    # --- the forwarder ------------------------------------------------------------------------
    def _ready(self, st: _Step, now: float) -> bool:
        """Whether the host's ballot for ``key`` goes now (the module doc's rule)."""
        return st.arrived >= len(self._last) or now >= self._due_at(st)

    def _due_at(self, st: _Step) -> float:
        """When a step's held votes go though not every process has voted: ``coalesce_s``
        after its first vote, and after each ballot that went, so that votes coming apart
        go in one ballot every ``coalesce_s``, not one each (a leader's members vote up to
        tens of ms apart: one ballot a member at the job's store was nearly a flat vote's
        load, benchmarks/results/vote_groups_spread.md)."""
        return (st.cast_at if st.sent else st.first_at) + self.coalesce_s

    def _forward(self) -> None:
        while True:
            with self._cv:
                while True:
                    now = time.monotonic()
                    due = [(key, st) for key, st in self._steps.items()
                           if len(st.sent) < len(st.voters) and self._ready(st, now)]
                    if due:
                        break
                    waiting = [self._due_at(st) - now
                               for st in self._steps.values() if len(st.sent) < len(st.voters)]
                    self._cv.wait(max(0.0, min(waiting)) if waiting else None)
                batches = []
                for key, st in due:
                    names = sorted(set(st.voters) - st.sent)
                    st.sent.update(names)
                    st.cast_at = now
                    if st.via_group is None:
                        st.via_group = self.group is not None and self.group.ready()
                    batches.append((key, st, names, self.group if st.via_group else None))
            for key, st, names, group in batches:
                if group is not None:
                    self._cast_in_group(group, key, st, names)
                else:
                    self._cast(key, st, names)

    def _cast_in_group(self, group, key: tuple[int, int], st: _Step, names: list[str]) -> None:
        """The ballot into the group's store: an append that waits for no answer and no
        count (the leader counts what it relays; a store gone is seen by the wait)."""
        try:
            group.forward.cast_host_ballot(P.commit_key(*key, "ballots"), self.node, names)
        except (OSError, StoreError) as exc:
            group.lose(f"casting into its store: {exc}")
            return
        if not st.waited:
            st.waited = True
            self._waits.put(key)

    def _cast(self, key: tuple[int, int], st: _Step, names: list[str]) -> None:
        store = self.forward_store
        ballots = P.commit_key(*key, "ballots")
        # the ballot and the count in one write (on the built-in store)
        own, members = _by_host(st, names)
        st.count = store.cast_host_ballot_and_count(ballots, self.node, own,
                                                    P.commit_key(*key, "votes"), members)
        if st.count >= self.num_voters:
            self._decide(store, key, st)
        if not st.waited:
            st.waited = True
            self._waits.put(key)

    def _decide(self, store, key: tuple[int, int], st: _Step) -> None:
        """Commit, if the ballots hold every voter; this host's ballot cast again if it was
        erased (an overwritten key: nobody would ever decide)."""
        ballots = P.commit_key(*key, "ballots")
        count, present = store.ballot_tally(ballots, {self.node, *st.member_of.values()})
        missing = sorted(st.sent - present)
        if missing:
            own, members = _by_host(st, missing)
            store.cast_host_ballot(ballots, self.node, own, members)
            count += len(missing)
        if count >= self.num_voters:
            store.compare_set(P.commit_key(*key, "decision"), "", "commit")

    # --- the waiter ---------------------------------------------------------------------------
    def _wait(self) -> None:
        while True:
            key = self._waits.get()
            value = self._decision(key)
            with self._cv:
                st = self._steps.pop(key, None)
                self._decided[key] = value
                while len(self._decided) > DECISIONS_KEPT:
                    self._decided.popitem(last=False)
                # (a member host's voters share one record: told once, and first: its
                # members' processes wait two hops further)
                children = sorted({id(c): c for c in st.voters.values()}.values(),
                                  key=lambda c: not hasattr(c, "decided")) \
                    if st is not None else []
                # member hosts that voted on none of the steps up to this one have no voters
                # now: not waited for any more
                for name in [n for n, last in self._last.items()
                             if n.startswith(HOST_PROXY) and last < key]:
                    self._drop(name)
            for child in children:
                _tell(child, key, value)
            if self.on_decided is not None:
                self.on_decided(key, value)

    def _decision(self, key: tuple[int, int]) -> bytes:
        """The step's genuine decision (a forged value planted first is waited past),
        looking at the ballots again now and then while it waits (``RECHECK_S``)."""
        store = self.wait_store
        decision = P.commit_key(*key, "decision")
        st = self._steps[key]
        full_every = RECHECK_ALL_S * max(1.0, self.hosts / RECHECK_FULL_HOSTS)
        read_at = look_at = time.monotonic()
        while True:
            group = self.group
            if st.via_group and group is not None:
                try:
                    value = group.wait.await_value(decision, timedelta(seconds=RECHECK_S))
                except StoreTimeout:
                    # a leader that stopped relaying: the decision is read where it is taken
                    now = time.monotonic()
                    if now - look_at >= GROUP_LOOK_ROOT_S:
                        look_at = now
                        value = store.valid(decision)
                        if value is not None:
                            return value
                    continue
                except (OSError, StoreError) as exc:
                    group.lose(f"waiting in its store: {exc}")
                    continue
                if value is not None:
                    return value
                time.sleep(FORGED_POLL_S)      # forged in the group's store
                continue
            often = st.count >= self.num_voters - len(st.sent)
            try:
                # the wait and the read in one request: every host's is answered at the
                # decision, one after another by the store's one thread (2,048 hosts: a
                # wait then a read took ~2,000 requests more on each step's path)
                value = store.await_value(decision, timedelta(seconds=RECHECK_S if often
                                                              else RECHECK_ALL_S))
            except StoreTimeout:
                now = time.monotonic()
                if often or self._deputy(key) or now - read_at >= full_every or \
                        store.add(P.commit_key(*key, "votes"), 0) >= self.num_voters:
                    read_at = now
                    self._decide(store, key, st)
                continue
            if value is not None:
                return value
            time.sleep(FORGED_POLL_S)          # forged: the genuine one overwrites it
            self._decide(store, key, st)

    def _deputy(self, key: tuple[int, int]) -> bool:
        """Whether this host reads step ``key``'s ballots at every re-check (``RECHECK_DEPUTIES``
        hosts a step, a different few each step)."""
        return (self.root_index - key[1]) % self.hosts < RECHECK_DEPUTIES

    def _run(self, loop) -> None:
        try:
            loop()
        except (AuthError, OSError, RuntimeError) as exc:    # the store is gone
            self.error = exc


def _by_host(st: _Step, names: list[str]) -> tuple[list[str], dict[int, list[str]]]:
    """``names`` as this host's own processes' and, for a vote group's leader, each member
    host's (a ballot names them under their host: ``core/ballots.py``)."""
    if not st.member_of:
        return names, {}
    own, members = [], collections.defaultdict(list)
    for name in names:
        node = st.member_of.get(name)
        if node is None:
            own.append(name)
        else:
            members[node].append(name)
    return own, dict(members)


def _tell(child, key: tuple[int, int], decision: bytes) -> None:
    """The decision to one voter (a process that exited meanwhile is past caring; one whose
    channel is full reads the decision in the store: ``worker/liveness.HostVote``), or to
    the member hosts of this host's vote group (``GroupLeader.decided``)."""
    decided = getattr(child, "decided", None)
    if decided is not None:
        decided(key, decision)
    else:
        send_on(child, P.decision_message(*key, decision))


def send_on(child, message: bytes) -> str:
    """``message`` onto the process's channel, without waiting: ``"sent"``, ``"later"`` (the
    channel is full), ``"too big"`` (a datagram past the socket's limit) or ``"gone"`` (the
    process exited, its channel closed)."""
    channel = child.channel
    if channel is None:
        return "gone"
    try:
        channel.send(message)
        return "sent"
    except BlockingIOError:
        return "later"
    except OSError as exc:
        return "too big" if exc.errno == errno.EMSGSIZE else "gone"
