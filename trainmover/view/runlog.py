"""What a run dir's logs say, for the operator view (dashboard, metrics, report): the loss
and throughput over time, each interruption with its phases, and counts. Read from
``events.jsonl`` and ``metrics.jsonl`` only, so it works for a running job, a finished one
and a copy of one; read incrementally (``refresh`` reads what was appended since), so a
dashboard polled every second costs a stat per file when nothing happened, on a job of any
length. Torch-free."""
from __future__ import annotations

import json
import os
from collections import Counter, deque
from dataclasses import dataclass, field

# Failure kinds in the order that names a recovery with several (a host loss explains its
# workers' crashes and hangs); the label set stays bounded for the metrics.
FAILURE_KINDS = ("host", "crash", "hang", "commerr")
INTERRUPTION_KINDS = ("planned", "straggler", *FAILURE_KINDS)

# Each interruption's phases, in order, with whether training stood still during them.
MIGRATION_PHASES = (("prepare_s", "prepare (background)", False),
                    ("wait_boundary_s", "wait for the boundary (background)", False),
                    ("transfer_s", "state transfer", True),
                    ("group_switch_s", "group switch", True),
                    ("first_step_s", "joiner's first step", True))
RECOVERY_PHASES = (("detect_s", "detection", True),
                   ("collect_s", "abort and collect", True),
                   ("rebuild_and_first_step_s", "rebuild, transfer, first step", True))

EVENTS_KEPT = 200          # the newest notable events, for the timeline's tail
NOTABLE = {"job_started", "job_done", "job_abandoned", "job_stopped", "migration_started",
           "migration_done", "migration_aborted", "migration_interrupted", "migration_refused",
           "failure_detected", "recovery_planned", "recovery_resumed", "recovery_done",
           "recovery_abandoned", "straggler_detected", "straggler_cleared", "straggler_migration",
           "controller_lost", "controller_restarted", "controller_resumed", "host_lost",
           "standby_state", "standby_died", "standby_hung", "main_thread_stalled",
           "replicas_disagree", "rebalance"}


class JsonlTail:
    """Reads the complete lines appended to a JSONL file since the last call; a line that is
    not JSON (a torn write, a foreign line) is skipped and counted."""

    def __init__(self, path: str):
        self.path = path
        self.offset = 0
        self.bad_lines = 0
        self._buf = b""

    def read_new(self) -> list[dict]:
        try:
            size = os.stat(self.path).st_size
        except FileNotFoundError:
            return []
        if size < self.offset:      # replaced by a shorter file: read it again from the start
            self.offset, self._buf = 0, b""
        if size == self.offset:
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read(size - self.offset)
        self.offset += len(chunk)
        *lines, self._buf = (self._buf + chunk).split(b"\n")
        out = []
        for line in lines:
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                self.bad_lines += 1
                continue
            if isinstance(rec, dict):
                out.append(rec)
            else:
                self.bad_lines += 1
        return out


@dataclass
class Phase:
    name: str
    label: str
    seconds: float
    stalled: bool                  # training stood still (downtime) during it


@dataclass
class Interruption:
    what: str                      # "migration" | "recovery"
    id: int
    kind: str                      # one of INTERRUPTION_KINDS
    status: str                    # done, aborted, interrupted, failed
    time: float                    # when it ended (unix seconds)
    step: int | None               # the step training resumed at
    downtime_s: float | None
    phases: list[Phase]
    workers: list[str]             # leavers / failed workers
    record: dict                   # the full record, as in summary.json

    @property
    def title(self) -> str:
        return f"{self.what} {self.id}"


def migration_kind(record: dict) -> str:
    return "straggler" if record.get("source") == "straggler" else "planned"


def recovery_kind(record: dict) -> str:
    kinds = set((record.get("failures") or {}).values())
    for k in FAILURE_KINDS:
        if k in kinds:
            return k
    return "crash"


def _phases(record: dict, spec) -> list[Phase]:
    got = record.get("phases") or {}
    return [Phase(key, label, float(got[key]), stalled) for key, label, stalled in spec
            if isinstance(got.get(key), (int, float))]


def interruption_of(event: dict) -> Interruption | None:
    """The interruption an event ends (``migration_done``/``_aborted``/``_interrupted``,
    ``recovery_done``), else None."""
    name = event.get("event")
    if name in ("migration_done", "migration_aborted", "migration_interrupted"):
        status = event.get("status") or name.split("_", 1)[1]
        return Interruption(
            "migration", int(event.get("migration_id", 0)), migration_kind(event), status,
            float(event.get("time", 0.0)), event.get("switch_step"), event.get("downtime_s"),
            _phases(event, MIGRATION_PHASES) if status == "done" else [],
            [p.get("leaver") for p in event.get("pairs", [])], event)
    if name == "recovery_done":
        return Interruption(
            "recovery", int(event.get("recovery_id", 0)), recovery_kind(event),
            event.get("status", "done"), float(event.get("time", 0.0)),
            event.get("resume_step"), event.get("downtime_s"),
            _phases(event, RECOVERY_PHASES),
            sorted((event.get("failures") or {}).keys()), event)
    return None


@dataclass
class Point:
    time: float
    step: int
    loss: float | None
    tokens_per_s: float | None
    step_time_s: float | None


class Series:
    """Points of a growing series, at most ``cap`` of them: when full, every other point is
    dropped and from then on only every ``stride``-th new one is kept, so a week-long job's
    curve still spans the whole job in bounded memory."""

    def __init__(self, cap: int):
        self.cap, self.stride, self._seen = cap, 1, 0
        self.points: list[Point] = []

    def add(self, p: Point) -> None:
        self._seen += 1
        if (self._seen - 1) % self.stride:
            return
        self.points.append(p)
        if len(self.points) >= self.cap:
            self.points = self.points[::2]
            self.stride *= 2


@dataclass
class RunLog:
    """The run dir's logs, digested; ``refresh()`` takes in what was appended."""

    run_dir: str
    max_points: int = 2000
    interruptions: list[Interruption] = field(default_factory=list)
    stragglers: list[dict] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)     # event name -> how many
    failures: Counter = field(default_factory=Counter)   # failure kind -> how many
    recent: deque = field(default_factory=lambda: deque(maxlen=EVENTS_KEPT))
    started: dict | None = None
    ended: dict | None = None
    last: Point | None = None

    def __post_init__(self):
        self.series = Series(self.max_points)
        self._events = JsonlTail(os.path.join(self.run_dir, "events.jsonl"))
        self._metrics = JsonlTail(os.path.join(self.run_dir, "metrics.jsonl"))

    def refresh(self) -> "RunLog":
        for e in self._events.read_new():
            self._event(e)
        for r in self._metrics.read_new():
            if not isinstance(r.get("step"), int):
                continue
            p = Point(float(r.get("time", 0.0)), r["step"], _num(r.get("loss")),
                      _num(r.get("tokens_per_s")), _num(r.get("step_time_s")))
            self.series.add(p)
            self.last = p
        return self

    def _event(self, e: dict) -> None:
        name = e.get("event")
        if not isinstance(name, str):
            return
        self.counts[name] += 1
        if name == "job_started":
            self.started = e
        elif name in ("job_done", "job_abandoned", "job_stopped"):
            self.ended = e
        elif name == "failure_detected":
            for f in e.get("failures", []):
                self.failures[f.get("kind", "crash")] += 1
        elif name == "straggler_detected":
            self.stragglers.append(e)
        it = interruption_of(e)
        if it is not None:
            self.interruptions.append(it)
        if name in NOTABLE and not (name == "standby_state" and e.get("state") == "starting"):
            self.recent.append(e)

    def by_status(self, what: str) -> Counter:
        return Counter(i.status for i in self.interruptions if i.what == what)


def _num(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None
