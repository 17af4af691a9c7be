"""A worker's side of failure handling: liveness, the step commit vote, aborting a step.

- ``Heartbeat``: a daemon thread sends a beat on the worker's channel to its host's agent
  every interval (no store traffic: the agent counts its processes' beats and writes one
  ``HostBeat`` for the host). A process that is stopped (SIGSTOP) or wedged stops beating;
  the controller fences it.
- ``Inbox.watch_abort``: the host's agent waits for ``abort/<epoch>`` (once for the host) and
  says so on the worker's channel; then the worker's ``AbortSignal`` fires: the step in
  flight is doomed (``comm/groups.py``), and any wait outside a step raises
  ``StepAborted``. ``AbortWatcher`` is the same wait in the worker's own thread, for a
  worker no agent started (or whose agent is gone).
- ``CommitVote``: no step is ever half-applied. After a step's collectives (gradients, norm,
  loss) and before the optimizer touches anything, every worker adds its vote; the last voter
  writes ``commit`` with a compare-and-set; the controller, on a failure, writes ``abort``
  the same way. Whichever lands first is the decision, recorded in one place.
"""
from __future__ import annotations

import contextlib
import os
import queue
import select
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta

from trainmover.core import protocol as P
from trainmover.core.auth import AuthError, store_timeout_s
from trainmover.comm.groups import AbortSignal, CommError, StepAborted, StoreClients

# How often the abort watcher looks again while a forged value sits at the abort key (the
# genuine abort, when it comes, is seen this much later at most).
FORGED_ABORT_POLL_S = 0.05
# How often the voter one short of the vote count, and the step's reporter whatever count it
# drew, look at the ballots themselves while they wait for the decision (a forged decrement
# of the counter leaves nobody at the count; a counter overwritten again and again hands
# every voter a low count, so the reporter is the one who still looks often), and how often
# every other waiting voter does (an erased ballot is cast again). Rarer for the many: the
# ballots are one line per voter, and a wait that long is a hung peer's, during which N
# voters reading N lines each second would be O(N^2) bytes through the store; two readers a
# second are O(N).
BALLOT_RECHECK_S = 1.0
BALLOT_RECHECK_ALL_S = 10.0


class MainProgress:
    """Whether the worker's main thread, the one that trains, still makes progress: a
    heartbeat thread beats on even when that thread is wedged (a deadlock in a data loader,
    a lock never released), which would leave the job waiting on it forever.

    Signs of life: a step started (``tick``), and every poll of a wait by that thread (the
    waits of collectives, transfers, group builds and recovery poll the abort signal; the
    command channel ticks as it waits). A wait the controller always ends (the commit
    vote's) counts as progress while it lasts (``waiting``). Judged only while ``armed``
    (the training loop); ``stalled_s`` is how long no sign was seen."""

    def __init__(self, signal: AbortSignal):
        self.signal = signal
        self.armed = False
        self._at = time.monotonic()
        self._waiting = False

    def tick(self) -> None:
        self._at = time.monotonic()

    def arm(self, on: bool) -> None:
        self.tick()
        self.armed = on

    @contextlib.contextmanager
    def waiting(self):
        self._waiting = True
        try:
            yield
        finally:
            self._waiting = False
            self.tick()

    def stalled_s(self) -> float:
        if not self.armed or self._waiting:
            return 0.0
        return time.monotonic() - max(self._at, self.signal.polled_at)


def main_thread_stack(limit: int = 12) -> list[str]:
    """Where the main thread is now (the innermost ``limit`` frames), for the operator."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    return [] if frame is None else \
        [line.rstrip() for line in traceback.format_stack(frame)[-limit:]]


class Heartbeat:
    """Beats on ``channel`` (the worker's end of its channel to the agent: a message a beat)
    every ``interval_s``, unless the main thread made no progress for ``stall_s``
    (``MainProgress``; 0: not judged): then it reports where that thread is stuck
    (``main_thread_stalled``, once) and stops beating, so the controller fences the worker
    as hung, as it would a stopped process."""

    def __init__(self, channel: socket.socket, worker: str, interval_s: float,
                 progress: MainProgress | None = None, stall_s: float = 0.0, events=None):
        self.worker, self.interval_s = worker, interval_s
        self.progress, self.stall_s, self.events = progress, stall_s, events
        self.channel = channel
        channel.setblocking(False)
        threading.Thread(target=self._loop, name=f"heartbeat-{worker}", daemon=True).start()

    def _loop(self) -> None:
        reported = False
        while True:
            stalled = self.progress.stalled_s() if self.progress and self.stall_s else 0.0
            if stalled > self.stall_s:
                if not reported and self.events is not None:
                    self.events.emit("main_thread_stalled", stalled_s=round(stalled, 3),
                                     stack=main_thread_stack(), level="error")
                reported = True
            else:
                reported = False
                try:
                    self.channel.send(b"b")
                except BlockingIOError:
                    pass       # the agent has not read the last ones yet: they count
                except OSError:
                    return     # the agent is gone: so is the job
            time.sleep(self.interval_s)


def agent_channel() -> socket.socket | None:
    """This process's channel to its host's agent (``P.AGENT_CHANNEL_ENV``), None if it was
    not started by one."""
    fd = os.environ.get(P.AGENT_CHANNEL_ENV)
    if not fd:
        return None
    try:
        return socket.socket(fileno=int(fd))
    except (ValueError, OSError):
        return None


class AbortWatcher:
    """Fires ``signal`` when the controller aborts the current epoch's step."""

    def __init__(self, stores: StoreClients, signal: AbortSignal, epoch: int):
        self.signal = signal
        self._stores = stores
        self.epoch = epoch
        self._thread = threading.Thread(target=self._loop, args=(epoch,), daemon=True,
                                        name=f"abort-watch-{epoch}")
        self._thread.start()

    def _loop(self, epoch: int) -> None:
        try:
            store = self._stores.get()
        except Exception:  # noqa: BLE001 - the store is gone (the job with it)
            return
        key = P.abort_key(epoch)
        while True:
            try:
                store.wait([key], timedelta(seconds=P.IDLE_WAIT_S))
                reason = store.valid(key)
            except Exception:  # noqa: BLE001 - long idle wait, or the store is gone
                try:
                    store.check([key])
                except Exception:  # noqa: BLE001
                    return
                continue
            if reason is None:
                # a forged abort: not obeyed, and the wait would return at once; the
                # controller's genuine one overwrites it
                time.sleep(FORGED_ABORT_POLL_S)
                continue
            self.signal.set(f"epoch {epoch} aborted: {reason.decode()}")
            return


class CommitVote:
    """The step's commit decision (see module doc). Costs each worker three or four store
    round trips per step; ``votes`` counts voters of the current epoch only.

    The vote counter is a hint: a value there nobody of the job wrote must not decide or
    stall a step. Each voter also appends its signed ballot, and "commit" is written only
    once the ballots of every voter are there. A forged increment thus only makes one more
    voter look; a forged decrement or an overwritten counter leaves nobody at the count, so
    the waiting voters look at the ballots again (the one short of the count and the step's
    reporter every ``BALLOT_RECHECK_S``, the others every ``BALLOT_RECHECK_ALL_S``) and cast
    their own again if the key was overwritten."""

    def __init__(self, stores: StoreClients, num_voters: int, epoch: int,
                 reporter: str | None = None, progress: MainProgress | None = None,
                 voter: str = ""):
        self.store = stores.get()
        self.num_voters, self.epoch = num_voters, epoch
        self.reporter = reporter  # set on the worker whose metrics record the step
        self.progress = progress  # ticked while waiting for the decision
        self.voter = voter or reporter or ""

    def __call__(self, step: int, info: dict) -> bool:
        if self.reporter is not None:
            # kept with the vote, so a committed step's record survives its reporter dying
            # between the decision and writing metrics.jsonl (the controller backfills it)
            self.store.set(P.commit_key(self.epoch, step, "metrics"),
                           P.encode({"step": step, **info, "worker": self.reporter}))
        ballots = P.commit_key(self.epoch, step, "ballots")
        self.store.cast_ballot(ballots, self.voter)
        votes = self.store.add(P.commit_key(self.epoch, step, "votes"), 1)
        decision = P.commit_key(self.epoch, step, "decision")
        if votes >= self.num_voters:
            self._decide(ballots, decision)
        # waiting for a slow (or wedged) peer's vote is not being wedged: the controller
        # ends this wait by deciding the step, whatever the peers do
        waiting = self.progress.waiting() if self.progress is not None else \
            contextlib.nullcontext()
        with waiting:
            often = votes >= self.num_voters - 1 or self.reporter is not None
            every = BALLOT_RECHECK_S if often else BALLOT_RECHECK_ALL_S
            return self._wait(decision, ballots, every) == b"commit"

    def _decide(self, ballots: str, decision: str) -> None:
        voters = self.store.ballot_voters(ballots)
        if self.voter not in voters:
            # its ballot is gone (the key overwritten): cast again, or nobody ever decides
            self.store.cast_ballot(ballots, self.voter)
            voters.add(self.voter)
        if len(voters) >= self.num_voters:
            self.store.compare_set(decision, "", "commit")

    def _wait(self, decision: str, ballots: str, every: float) -> bytes:
        """The genuine decision (a forged one planted before it is waited past). The voter
        looks at the ballots again every ``every`` seconds while it waits: a counter
        overwritten or bumped down leaves nobody at the count, and then whoever looks
        decides (a step decides in milliseconds: the look costs nothing otherwise)."""
        deadline = time.monotonic() + store_timeout_s(self.store.raw)
        recheck_at = time.monotonic() + every
        while True:
            try:
                self.store.raw.wait([decision], timedelta(seconds=every))
            except Exception:  # noqa: BLE001 - not decided yet (a store gone fails below)
                if time.monotonic() > deadline:
                    raise
                self._decide(ballots, decision)
                recheck_at = time.monotonic() + every
                continue
            value = self.store.valid(decision)
            if value is not None:
                return value
            # A forged value holds the key, so ``wait`` returns at once from now on: the
            # ballots are looked at here instead. (With a forged decrement of the count as
            # well, nobody else decides: this loop once spun on the forged value for ever.)
            now = time.monotonic()
            if now > deadline:
                raise AuthError(f"{decision}: no genuine decision within the store's timeout "
                                f"(forged ones kept being written there)")
            if now >= recheck_at:
                self._decide(ballots, decision)
                recheck_at = now + every
            time.sleep(FORGED_ABORT_POLL_S)


class Inbox:
    """The worker's side of its channel to its host's agent, read by a daemon thread: the
    steps' decisions (for ``HostVote``), the aborts of the epochs it watches
    (``watch_abort``: the agent waits for them in the store, once for its host:
    ``agent/aborts.py``) and the controller's commands (``commands``, for
    ``worker/commands.CommandChannel``: ``agent/commands.py``). The beats go the other way
    (``Heartbeat``).

    If the agent goes (the channel closes), the epochs still watched are watched in the
    store itself (``AbortWatcher``), as is every later one, and the votes read the
    decision there (``HostVote``)."""

    DECISIONS_KEPT = 64

    def __init__(self, channel: socket.socket, stores: StoreClients):
        self.channel, self._stores = channel, stores
        channel.setblocking(False)
        self.closed = False
        self._cv = threading.Condition()
        self._decisions: dict[tuple[int, int], bytes] = {}
        self._watches: dict[int, list[AbortSignal]] = {}
        self.commands: queue.Queue = queue.Queue()      # the controller's, decoded
        threading.Thread(target=self._loop, name="agent-inbox", daemon=True).start()

    def send(self, message: bytes) -> None:
        """Onto the channel (non-blocking: the heartbeat shares it), waiting while the
        agent has not read what is in it yet."""
        while True:
            try:
                self.channel.send(message)
                return
            except BlockingIOError:
                poller = select.poll()
                poller.register(self.channel, select.POLLOUT)
                poller.poll(FORGED_ABORT_POLL_S * 1000)

    def watch_abort(self, signal: AbortSignal, epoch: int) -> None:
        """Fire ``signal`` when the controller aborts ``epoch`` (as ``AbortWatcher``). A
        worker watches one epoch at a time: the earlier ones' watches end here, as its
        agent ends them on this ask."""
        with self._cv:
            if not self.closed:
                for old in [e for e in self._watches if e < epoch]:
                    del self._watches[old]
                self._watches.setdefault(epoch, []).append(signal)
        if self.closed:
            AbortWatcher(self._stores, signal, epoch)
            return
        try:
            self.send(P.watch_message(epoch))
        except OSError:
            pass           # the agent is gone: the reader hands the watch to the store

    def decision(self, epoch: int, step: int, timeout_s: float) -> bytes | None:
        """The step's decision as the agent relayed it, waiting up to ``timeout_s``."""
        key = (epoch, step)
        with self._cv:
            if key not in self._decisions and not self.closed:
                self._cv.wait(timeout_s)
            return self._decisions.pop(key, None)

    def _loop(self) -> None:
        poller = select.poll()
        poller.register(self.channel, select.POLLIN)
        while True:
            # poll, not select: a worker's descriptors pass select's limit of 1024 with
            # its groups' connections in a job of thousands
            if not poller.poll(1000):
                continue
            try:
                raw = self.channel.recv(P.COMMAND_CHANNEL_MAX)
            except BlockingIOError:
                continue
            except OSError:
                raw = b""
            if not raw:
                self._agent_gone()
                return
            got = P.read_channel_message(raw)
            if got is not None and got[0] == "d":
                with self._cv:
                    self._decisions[(got[1], got[2])] = got[3].encode()
                    while len(self._decisions) > self.DECISIONS_KEPT:
                        del self._decisions[next(iter(self._decisions))]
                    self._cv.notify_all()
                continue
            command = P.read_command_message(raw)
            if command is not None:
                try:
                    self.commands.put(P.decode_command(command))
                except P.MessageError as exc:
                    # never half-obeyed: a message the protocol does not define is dropped
                    print(f"trainmover: refused command {command[:200]!r}: {exc}", flush=True)
                continue
            abort = P.read_abort_message(raw)
            if abort is not None:
                with self._cv:
                    signals = self._watches.pop(abort[0], [])
                for signal in signals:
                    signal.set(f"epoch {abort[0]} aborted: {abort[1]}")

    def _agent_gone(self) -> None:
        with self._cv:
            self.closed = True
            watches, self._watches = self._watches, {}
            self._cv.notify_all()
        for epoch, signals in watches.items():
            for signal in signals:
                AbortWatcher(self._stores, signal, epoch)


class HostVote:
    """The step's commit vote through the host's agent (``agent/votes.py``): the worker
    sends its vote on its channel and waits there for the decision (``Inbox``), which the
    agent relays once the host's ballot is in the store and the job's decision is taken. The
    store sees one ballot a host, not one a worker. The decision is the store's, one
    compare-and-set as with ``CommitVote``: when this epoch is aborted (``signal``), or
    every ``BALLOT_RECHECK_ALL_S`` of a long wait (an agent that is gone), the worker reads
    it there itself."""

    def __init__(self, inbox: Inbox, stores: StoreClients, epoch: int,
                 signal: AbortSignal, reporter: str | None = None,
                 progress: MainProgress | None = None, voter: str = ""):
        self.inbox, self.signal = inbox, signal
        self.store = stores.get()
        self.epoch = epoch
        self.reporter, self.progress = reporter, progress
        self.voter = voter or reporter or ""

    def __call__(self, step: int, info: dict) -> bool:
        if self.reporter is not None:
            # kept with the vote, as CommitVote does (a reporter dying after the decision)
            self.store.set(P.commit_key(self.epoch, step, "metrics"),
                           P.encode({"step": step, **info, "worker": self.reporter}))
        try:
            self.inbox.send(P.vote_message(self.epoch, step, self.voter))
        except OSError:
            pass        # the agent is gone: the decision is read in the store
        waiting = self.progress.waiting() if self.progress is not None else \
            contextlib.nullcontext()
        with waiting:
            return self._wait(step) == b"commit"

    def _wait(self, step: int) -> bytes:
        decision = P.commit_key(self.epoch, step, "decision")
        deadline = time.monotonic() + store_timeout_s(self.store.raw)
        look_at = time.monotonic() + BALLOT_RECHECK_ALL_S
        while True:
            value = self.inbox.decision(self.epoch, step, FORGED_ABORT_POLL_S)
            if value is not None:
                return value
            if self.inbox.closed:
                look_at = 0.0                 # the agent is gone: the store says
                time.sleep(FORGED_ABORT_POLL_S)
            now = time.monotonic()
            if self.signal.is_set() or now >= look_at:
                value = self.store.valid(decision)
                if value is not None:
                    return value
                look_at = now + BALLOT_RECHECK_ALL_S
            if now > deadline:
                raise AuthError(f"{decision}: no decision within the store's timeout")


def is_step_failure(exc: BaseException, signal: AbortSignal) -> bool:
    """Errors that mean "this step (or this recovery) cannot finish": a failed operation or
    an abort, anywhere in the exception's chain, or while the job's abort signal is set."""
    seen = exc
    while seen is not None:
        if isinstance(seen, (StepAborted, CommError)):
            return True
        seen = seen.__cause__ or seen.__context__
    return signal.is_set()
