"""What the controller's drivers share, passed to each explicitly: the job's spec and run dir,
its store and agent, the membership, the vote epoch, and the *outbox* through which every
driver talks to the outside world.

Each driver (migrations, recovery, health, the restart baseline, process supervision) owns
its own state and calls only public methods of the others; everything they all read or
change lives here. The whole of it is plain data that goes into the controller's snapshot
(``STATE``), except the live handles (store, event log, progress tail).
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field

from trainmover.core import decisions as C
from trainmover.core import protocol as P
from trainmover.core.auth import read_valid
from trainmover.core.codec import Table
from trainmover.core.config import JobConfig
from trainmover.core.events import read_jsonl
from trainmover.control.processes import AgentClient


def worker_names(n: int, prefix: str = "w") -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


# The controller keeps this many of the newest metrics records in memory (the downtime of an
# event is measured from the records around it, within steps of it; the file keeps them all):
# a job of 10^6 steps must not hold 10^6 records in the controller.
RECORDS_KEPT = 2000


class LiveLine:
    """One status line redrawn in place on a terminal (rich), with messages printed above
    it; None where stdout is not a terminal or rich is not installed (plain lines then)."""

    MIN_INTERVAL_S = 0.1       # redraws per second, at most 10: a terminal is not free

    @classmethod
    def make(cls) -> "LiveLine | None":
        if not sys.stdout.isatty() or os.environ.get("TRAINMOVER_PLAIN"):
            return None
        try:
            from rich.console import Console
            from rich.live import Live
        except ImportError:
            return None
        return cls(Live(console=Console(), auto_refresh=False, transient=False,
                        redirect_stdout=True, redirect_stderr=True))

    def __init__(self, live):
        self.live, self._drawn_at = live, 0.0
        self.live.start()

    def show(self, text: str, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._drawn_at >= self.MIN_INTERVAL_S:
            self._drawn_at = now
            from rich.text import Text
            self.live.update(Text(text), refresh=True)    # as written: no number colouring

    def say(self, text: str) -> None:
        self.live.console.print(text, markup=False, highlight=False)

    def close(self) -> None:
        self.live.stop()


def count_text(n: int) -> str:
    """A parameter count as people write it: 17, 12.3K, 0.87M, 1.30B."""
    if n >= 1e9:
        return f"{n / 1e9:.2f}B"
    if n >= 1e5:
        return f"{n / 1e6:.2f}M"
    return f"{n / 1e3:.1f}K" if n >= 1e3 else str(n)


@dataclass
class Progress:
    """Tails metrics.jsonl and keeps the newest records; shows each committed step: a live
    line on a terminal (step, loss, tokens/s, ETA, warm standbys), else one plain line per
    step (logs, CI)."""

    path: str
    total_steps: int
    enabled: bool = True
    records: list = field(default_factory=list)
    standbys: tuple[int, int] = (0, 0)        # (warm, all), kept current by the controller
    _offset: int = 0
    _buf: str = ""
    _live: LiveLine | None = None
    _live_tried: bool = False
    _params_said: bool = False

    @property
    def last_step(self) -> int:
        """The newest committed step (after a rollback, steps are committed again)."""
        return self.records[-1]["step"] if self.records else -1

    def poll(self) -> None:
        try:
            size = os.stat(self.path).st_size
        except FileNotFoundError:
            return
        if size == self._offset:
            return   # nothing new: the common case, one stat per supervision round
        with open(self.path) as f:
            f.seek(self._offset)
            chunk = f.read()
            self._offset = f.tell()
        self._buf += chunk
        *lines, self._buf = self._buf.split("\n")
        for line in lines:
            if not line:
                continue
            rec = json.loads(line)
            self.records.append(rec)
            if isinstance(rec.get("model_params"), int) and not self._params_said:
                self._params_said = True       # (a script's first record)
                self.say(f"{rec.get('model_params_of', 'the model')}: "
                         f"{count_text(rec['model_params'])} parameters (as registered)")
            if len(self.records) > 2 * RECORDS_KEPT:
                del self.records[:-RECORDS_KEPT]
            if self.enabled and self._display() is None:
                print(self._line(rec) + f"[{rec['worker']}]", flush=True)
        if self.enabled and self._display() is not None and lines:
            self._show(self.records[-1])   # the newest; a redraw per step would cost more

    def _line(self, rec: dict) -> str:
        loss = rec.get("loss")
        total = f"/{self.total_steps}" if self.total_steps else ""
        return (f"step {rec['step'] + 1:>5}{total}  "
                + (f"loss {loss:.4f}  " if isinstance(loss, (int, float)) else "")
                + f"{rec['step_time_s'] * 1000:8.1f} ms/step  "
                + (f"{rec['tokens_per_s']:>10.0f} tok/s  " if "tokens_per_s" in rec else ""))

    def eta_s(self) -> float | None:
        """Seconds left at the median step time of the newest steps (None: unknown)."""
        if not self.total_steps or not self.records:
            return None
        recent = sorted(r["step_time_s"] for r in self.records[-50:])
        return max(0, self.total_steps - self.last_step - 1) * recent[len(recent) // 2]

    def _display(self) -> "LiveLine | None":
        if not self._live_tried:
            self._live_tried, self._live = True, LiveLine.make()
        return self._live

    def _show(self, rec: dict) -> None:
        eta = self.eta_s()
        warm, count = self.standbys
        self._live.show(self._line(rec)
                        + (f"ETA {_duration(eta)}  " if eta is not None else "")
                        + (f"standbys warm {warm}/{count}" if count else "no standbys"),
                        force=rec["step"] + 1 == self.total_steps)

    def say(self, text: str) -> None:
        if not self.enabled:
            return
        if self._live is not None:
            self._live.say(f"trainmover: {text}")
        else:
            print(f"trainmover: {text}", flush=True)

    def close(self) -> None:
        """Give the terminal back (the live line)."""
        if self._live is not None:
            self._live.close()
            self._live = None


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class JobContext:
    """The job as every driver sees it. Orders to workers and process starts are queued
    (``put``, ``send``, ``spawn``) and go out only after the snapshot that contains them was
    saved; see ``coordinator.py``."""

    # plain data in the controller's snapshot
    STATE = ("membership", "epoch", "committed", "next_standby", "cmd_next", "outbox", "procs",
             "t_started", "gpus", "slots", "hosts")

    def __init__(self, cfg: JobConfig, run_dir: str, events, progress: Progress):
        self.cfg = cfg
        self.run_dir = run_dir
        self.events = events
        self.progress = progress
        self.store = None                    # set once connected
        self.secret: bytes | None = None     # the job's secret (snapshot holders), with it
        self.store_addr = ""
        self.procs = AgentClient(None, os.path.join(run_dir, "logs"))
        self.membership: C.Membership | None = None
        self.epoch = 0                       # the vote epoch the workers are in
        self.committed = -1                  # last step whose decision is known to be commit
        self.next_standby = cfg.standby.count
        self.cmd_next: dict[str, int] = Table()   # next command message number per host
        # ("set", key, value) | ("agent", node, request) | ("cmd", node, process, command)
        self.outbox: list[tuple] = []
        self.t_started = time.time()
        self.gpus = 0                        # GPUs per host (device "cuda")
        self.slots: dict[str, int] = {}      # process name -> its GPU on its host (LOCAL_RANK)
        self.hosts: dict[str, int] = Table()      # process name -> the host that runs it
        # when processes or groups last changed (start, restart, promotion, switch, resume):
        # the step watchdog judges only a job in steady state since then. Not in the
        # snapshot: a resumed controller judges afresh
        self.steady_since = time.time()
        # controller fault points reached in this round (tests, chaos): the coordinator
        # fires the ones scheduled once the round's snapshot is saved
        self.points_reached: list[str] = []

    # --- the outbox ----------------------------------------------------------------------------
    def put(self, key: str, value: str) -> None:
        """Set a store key the workers act on, once the snapshot that led to it is saved."""
        self.outbox.append(("set", key, value))

    def send(self, worker: str, command: P.Command) -> None:
        """A command to a process, through its host's agent (``agent/commands.py``): the
        round's commands to one host go as one message, after the rest of the outbox."""
        self.outbox.append(("cmd", self.place(worker), worker, P.encode_command(command)))

    def place(self, name: str) -> int:
        """The host of a process: ``w<i>`` and ``s<i>`` as ``HostsConfig`` says; a process
        keeps its host across restarts; a new one goes to no host declared lost."""
        if name not in self.hosts:
            hosts, index = self.cfg.hosts, int(name[1:])
            node = index // hosts.per_node(self.cfg.layout.num_roles) if name[0] == "w" \
                else index % hosts.nnodes
            live = [n for n in range(hosts.nnodes) if n not in self.procs.lost]
            self.hosts[name] = node if node in live or not live else live[index % len(live)]
        return self.hosts[name]

    def spawn_request(self, name: str, standby: bool, **restart) -> tuple[int, P.AgentSpawn]:
        """``restart``: a restarted worker's ``resume_step``, ``generation``, ``epoch``."""
        node = self.place(name)
        return self.procs.spawn_request(name, standby, node,
                                        self._slot(name, node) if self.gpus else None, **restart)

    def _slot(self, name: str, node: int) -> int:
        """A process keeps its GPU across restarts; a new one takes the lowest GPU of its host
        no live process holds (a failed worker's, for its replacement), or shares one
        round-robin where there are more processes than GPUs (gloo only, ``comm.backend``)."""
        if name not in self.slots:
            mine = {n: s for n, s in self.slots.items() if self.hosts.get(n) == node}
            held = {s for n, s in mine.items()
                    if not self.procs.known(n) or self.procs.running(n)}
            free = [g for g in range(self.gpus) if g not in held]
            self.slots[name] = free[0] if free else len(mine) % self.gpus
        return self.slots[name]

    def spawn(self, name: str, standby: bool, **restart) -> None:
        self.outbox.append(("agent", *self.spawn_request(name, standby, **restart)))

    def new_standby(self, state: C.StandbyState) -> str:
        """Name a standby process that is about to be started."""
        name = f"s{self.next_standby}"
        self.next_standby += 1
        self.membership.standbys[name] = state
        return name

    # --- done at once (idempotent when a resumed controller repeats them) ----------------------
    def fence(self, worker: str, why: str) -> None:
        """Kill a worker that is alive but failed: SIGKILL works on a stopped process too, and
        closing its sockets turns a hang into a crash. Killing a failed process twice is
        harmless, so this is not queued."""
        if self.procs.running(worker):
            self.procs.kill(worker)
        self.events.emit("fenced", name=worker, reason=why)

    def retire(self, standby: str) -> None:
        """A standby that prepared for a plan given up holds stale groups: stop it, never
        reuse it."""
        if self.procs.running(standby):
            self.procs.stop(standby, self.cfg.controller.stop_grace_s)
        self.membership.standbys[standby] = C.StandbyState.DEAD

    # --- shared facts --------------------------------------------------------------------------
    def disrupted(self) -> None:
        """Processes or groups just changed: the step watchdog waits for steady state."""
        self.steady_since = time.time()

    def read(self, cls, key: str):
        """The ``cls`` message at ``key``, or None if there is none. An unsigned or forged
        one reads as none (reported once per key, ``AuthStore.valid``); a malformed one is
        logged (``message_rejected``) and read as none too."""
        return _decoded(self, cls, key, self.store.valid(key))

    def reached(self, point: str) -> None:
        self.points_reached.append(point)

    def fault_events(self) -> list[dict]:
        """The workers' own records of faults injected into them (for detection latency)."""
        return [e for e in read_jsonl(os.path.join(self.run_dir, "events.jsonl"))
                if e["event"] == "fault_injected"]


def snapshot_of(obj) -> dict:
    """The fields a driver lists in its ``STATE``."""
    return {k: getattr(obj, k) for k in obj.STATE}


def restore_into(obj, state: dict) -> None:
    unknown = set(state) - set(obj.STATE)
    if unknown:
        raise ValueError(f"{type(obj).__name__}: unknown snapshot field(s) {sorted(unknown)}")
    for k, v in state.items():
        setattr(obj, k, v)


def read_messages(ctx, cls, keys: list[str]) -> list:
    """``JobContext.read`` of each of ``keys`` (``ctx``: its ``store`` and ``events``), in
    order, ``KEYS_PER_READ`` keys a request (a migration's accounting read its stayers'
    values one request each: 235 requests in one supervision round at 4K workers)."""
    return [_decoded(ctx, cls, key, raw) for key, raw in zip(keys, read_valid(ctx.store, keys))]


def _decoded(ctx, cls, key: str, raw: bytes | None):
    """The ``cls`` message in ``raw`` (read at ``key``), or None: none there, or one that
    does not decode (logged: ``message_rejected``)."""
    if raw is None:
        return None
    try:
        return P.read_message(cls, raw)
    except P.MessageError as exc:
        ctx.events.emit("message_rejected", key=key, error=str(exc))
        return None
