"""The store keys and messages shared by the coordinator and the workers. Pure (no torch):
everything that crosses a process boundary is named here, once.

Commands are JSON objects sent to a host's processes as one message a controller round
(``agent/<node>/cmd/<n>``, numbered by the controller, so a resumed controller re-sending
one writes the same key twice, never two messages); the host's agent waits on the next
index and relays each command on its process's channel, where the process's reader thread
queues it, so checking for a command costs the training loop one ``queue.Queue`` look-up per
step.
"""
from __future__ import annotations

import dataclasses
import json
import re
import types
import typing
from dataclasses import dataclass

SWITCH_MARGIN_STEPS = 3
"""How far ahead of the first participant's boundary the switch step is placed. Every
participant shares a group with the leaver that runs a blocking collective each step, so no
two participants are more than two boundaries apart; three is the smallest margin that no
participant can already have passed."""

IDLE_WAIT_S = 24 * 3600
"""How long one store wait for a key that may come arbitrarily late (a worker's next
command, an epoch's abort) lasts before it is re-armed. Not a timeout: the waiter loops,
checking only that the store is still there (the store's API has no unbounded wait)."""


def membership_key(worker: str) -> str:
    return f"membership/worker/{worker}"


def standby_state_key(worker: str) -> str:
    return f"standby/{worker}/state"


MIGRATION_KEYS = {
    # per participant ("/<worker>")
    "ready": "ReadyReport: phase 1 done",
    "switched": "SwitchReport: switched at the agreed step",
    "at_switch": "a leaver reached the switch step (the naive baseline starts its joiner)",
    "outcome": "a leaver's point of no return: 'handover' (leaver) or 'abort' (controller), "
               "decided by one compare-and-set",
    "steps": "StepEnds: a stayer's step-end times around the switch (the downtime)",
    "precopy_sums": "a pre-copying leaver's checksums of the state its joiner replayed, per "
                    "entry (per role)",
    # per migration
    "ready_count": "participants done with phase 1",
    "switched_count": "participants switched",
    "go": "the controller orders the switch",
    "switch_at": "the agreed switch step (first proposal wins a compare-and-set)",
    "abort": "the controller gave the migration up (the reason)",
}


def mig_key(migration_id: int, what: str, worker: str | None = None) -> str:
    """The keys of one migration (``MIGRATION_KEYS``)."""
    if what not in MIGRATION_KEYS:
        raise KeyError(f"no migration key {what!r}")
    base = f"mig/{migration_id}/{what}"
    return base if worker is None else f"{base}/{worker}"


REQUEST_KEYS = {"": "MigrationAsk from `trainmover migrate`",
                "status": "the controller's interim answer (queued, started)",
                "done": "the controller's final answer (done, refused, aborted, failed)"}


def request_key(index: int, what: str = "") -> str:
    if what not in REQUEST_KEYS:
        raise KeyError(f"no request key {what!r}")
    return f"req/{index}" + (f"/{what}" if what else "")


def finished_key(worker: str) -> str:
    """Set by a worker that completed the job: its heartbeat may stop from then on."""
    return f"finished/{worker}"


def abort_key(epoch: int) -> str:
    """Written by the controller to abandon the step in flight of ``epoch``."""
    return f"abort/{epoch}"


COMMIT_KEYS = {"votes": "workers that voted to commit the step (a counter: the hint)",
               "ballots": "the voters' signed ballots, one line each (what a decision is "
                          "checked against: a counter can be bumped by anyone)",
               "decision": "'commit' (the last vote) or 'abort' (the controller), decided by "
                           "one compare-and-set",
               "metrics": "the step's metrics record, kept with the reporter's vote"}


def commit_key(epoch: int, step: int, what: str) -> str:
    if what not in COMMIT_KEYS:
        raise KeyError(f"no commit key {what!r}")
    return f"commit/{epoch}/{step}/{what}"


def failure_key(epoch: int, worker: str) -> str:
    """A worker's own report of a failed step (the error it saw, its groups' accounting)."""
    return f"fail/{epoch}/{worker}"


def failure_count_key(epoch: int) -> str:
    """Counts the failure reports written in ``epoch``: the controller reads this one counter
    instead of every worker's report key."""
    return f"fail/{epoch}/count"


def recovered_count_key(recovery_id: int) -> str:
    """Counts the participants of a recovery that resumed training: a hint only, the
    signed notes (``HostRecovered``) say who did."""
    return f"recovery/{recovery_id}/recovered_count"


def own_recovered_key(recovery_id: int, worker: str) -> str:
    """``HostRecovered`` naming ``worker`` only: the note of a process no agent started."""
    return f"recovery/{recovery_id}/recovered/{worker}"


def checkpoint_key(epoch: int, step: int) -> str:
    """Counts the roles that finished writing, in ``epoch``, the checkpoint taken before
    ``step``."""
    return f"ckpt/{epoch}/{step}/written"


REQUEST_COUNT_KEY = "req/count"
MIGRATION_COUNT_KEY = "mig/count"
STOP_REQUEST_KEY = "stop/request"   # StopAsk from `trainmover stop`


def stop_step_key(stop_id: int) -> str:
    """The step a graceful stop happens at, agreed by the workers (first proposal wins a
    compare-and-set, as a migration's switch step)."""
    return f"stop/{stop_id}/at"


def encode(obj) -> str:
    """JSON for a value whose shape the protocol does not fix: the controller's answers to
    a ``trainmover migrate`` caller (read by a person), a step's metrics record."""
    return json.dumps(obj, sort_keys=True)


# --- the agents (one per host; host 0's hosts the store) and the controller's registration -

AGENT_EXIT_COUNT_KEY = "agent/exit/count"        # process exits, every host's
CONTROLLER_KEY = "controller/current"            # {"pid", "incarnation"} of the live one
CONTROLLER_INCARNATION_KEY = "controller/incarnation"
# With the store on etcd: the live controller's beat ("<incarnation>.<n>"), which the
# agents of the hosts after the controller's watch, and who takes over from a silent one.
CONTROLLER_BEAT_KEY = "controller/beat"


def controller_takeover_key(incarnation: int) -> str:
    """The host whose agent starts the controller after incarnation ``incarnation`` fell
    silent (the first compare-and-set wins)."""
    return f"controller/takeover/{incarnation}"
CONTROLLER_SNAPSHOT_KEY = "controller/snapshot"  # the controller's state, for a resume


def controller_snapshot_part_key(digest: str) -> str:
    """A part of a large table of the controller's snapshot, named by its digest
    (``core/codec.py``; the snapshot at ``CONTROLLER_SNAPSHOT_KEY`` lists its parts)."""
    return f"controller/snapshot_part/{digest}"


AGENT_KEYS = {
    "req/count": "requests queued for the host's agent",
    "req/done": "requests the host's agent has read (and deleted)",
    "info": "AgentInfo: the host's agent is serving",
    "hb": "HostBeat: the agent's heartbeat, with the processes it did not hear from lately",
    "perf": "HostPerf: the step measurements of the host's processes (straggler detector)",
    "snapshots": "host:port of the host's peer-snapshot holder (core/snapshots.py)",
    "fenced": "the host was declared lost: its agent stops its processes and exits",
    "done": "the agent stopped every process at the job's end",
    "done_ack": "the controller read 'done' (host 0's agent may now take the store down)",
}


def agent_key(node: int, what: str) -> str:
    """The keys of host ``node``'s agent (``AGENT_KEYS``)."""
    if what not in AGENT_KEYS:
        raise KeyError(f"no agent key {what!r}")
    return f"agent/{node}/{what}"


def host_reports_key(node: int, epoch: int) -> str:
    """``HostReports``: the failure reports of host ``node``'s processes in ``epoch``."""
    return f"agent/{node}/reports/{epoch}"


def host_recovered_key(node: int, recovery_id: int) -> str:
    """``HostRecovered``: the processes of host ``node`` done with recovery ``recovery_id``."""
    return f"agent/{node}/recovered/{recovery_id}"


def agent_request_key(node: int, index: int) -> str:
    return f"agent/{node}/req/{index}"


def host_command_key(node: int, index: int) -> str:
    """The controller's commands to host ``node``'s processes, numbered (``HostCommands``):
    its agent reads, deletes and relays each on the named process's channel."""
    return f"agent/{node}/cmd/{index}"


def agent_proc_key(name: str) -> str:
    return f"agent/proc/{name}"


def agent_exit_key(index: int) -> str:
    return f"agent/exit/{index}"


def final_shards_key() -> str:
    """Counts the data-parallel-rank-0 roles that wrote their final state."""
    return "final/shards"


def rendezvous_keys(group: str, generation: int, size: int) -> list[str]:
    """The keys a gloo communicator's rendezvous leaves in the store (one address per rank,
    under ``comm.groups.group_prefix``, its single device's index "0"); read only while the
    communicator is being built."""
    return [f"groups/{group}/gen{generation}//0/{rank}" for rank in range(size)]


def nccl_id_key(group: str, generation: int) -> str:
    """The key a NCCL communicator's rendezvous leaves in the store: its unique id, set by
    rank 0 and read by the others (``ProcessGroupNCCL``'s first communicator, "0", under
    ``comm.groups.group_prefix``): one key of 128 bytes, where gloo's full mesh leaves one
    of ``154 + 8 * size`` bytes a member, each read by every member."""
    return f"groups/{group}/gen{generation}//0"


def group_keys(group: str, generation: int, size: int, backend: str) -> list[str]:
    """The rendezvous keys of one communicator for ``comm.backend`` (both forms for "auto":
    the controller cannot tell which the workers resolved it to)."""
    keys = [] if backend == "nccl" else rendezvous_keys(group, generation, size)
    return keys if backend == "gloo" else keys + [nccl_id_key(group, generation)]


def final_need_key(role: str) -> str:
    """Set by the controller when the holder of data-parallel-rank-0 ``role`` died after the
    job's last step was committed: names the replica that writes that role's final state
    instead (and assembles the whole, for role dp0.pp0.tp0)."""
    return f"final/need/{role}"


EXIT_USAGE = 3
"""A worker's exit code when the training script misuses the runtime (state not registered,
commit point skipped, data not a function of the step): a bug to fix, not a failure to
recover from, so the controller stops the job with the worker's message."""

FINGERPRINT_STEPS = (1, 2)
"""Steps whose batch fingerprints the representative roles publish: a standby's shadow run
starts at step 1, as a joiner starts at some step after 0, and compares its batches with them
(a script whose data is an iterator's state would feed a joiner its first batch again)."""


def batch_fingerprint_key(structure: str, step: int) -> str:
    return f"fp/{structure}/{step}"


def replica_digest_key(step: int, role: str) -> str:
    """A role's state digest taken before ``step`` (the job's end: ``train.steps``), which
    the controller compares across data-parallel replicas."""
    return f"verify/{step}/{role}"


RESUMED_KEY = "job/resumed_from"
"""Set when the job continues a stopped one (the step): its workers start past the
fingerprinted steps, so no fingerprint will come to compare a standby's with."""


# --- messages -------------------------------------------------------------------------------
# Everything that crosses a process boundary through the store is a dataclass written as JSON
# and validated when read: an unknown type or field, a field of the wrong type or an
# oversized message is refused with ``MessageError`` (the reader logs it and goes on, never
# half-obeys it and never dies of it). Keys name their message type (``standby/<w>/state``
# holds a ``StandbyReport``); lists of orders (worker commands, agent requests) carry a
# ``type`` tag.

MAX_MESSAGE_BYTES = 256 * 1024


class MessageError(ValueError):
    """A message that is not one the protocol defines."""


def write_message(msg) -> str:
    return json.dumps(msg, default=json_fields, sort_keys=True)


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def json_fields(obj) -> dict:
    """json's ``default`` for a dataclass: its fields, whose values json encodes itself
    (``dataclasses.asdict`` deep-copies every leaf first: 8.5 us a host's beat, 56 us a
    window's step measurements, written by every agent every beat)."""
    names = _FIELD_NAMES.get(type(obj))
    if names is None:
        if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
            raise TypeError(f"{type(obj).__name__} is not JSON")
        names = _FIELD_NAMES[type(obj)] = tuple(f.name for f in dataclasses.fields(obj))
    return {name: getattr(obj, name) for name in names}


def read_message(cls, raw: bytes | str):
    """``raw`` as a ``cls``, or ``MessageError``."""
    return _build(cls, _parse(cls.__name__, raw))


def read_object(raw: bytes | str) -> dict:
    """A JSON object of free shape (a metrics record), size-checked."""
    data = _parse("record", raw)
    if not isinstance(data, dict):
        raise MessageError(f"record: expected an object, got {type(data).__name__}")
    return data


def _parse(what: str, raw: bytes | str):
    if len(raw) > MAX_MESSAGE_BYTES:
        raise MessageError(f"{what} of {len(raw)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise MessageError(f"{what} is not JSON: {exc}") from exc


def _tagged(registry: dict, kind: str):
    names = {cls: name for name, cls in registry.items()}

    def write(msg) -> str:
        return json.dumps({"type": names[type(msg)], **json_fields(msg)}, default=json_fields,
                          sort_keys=True)

    def read(raw: bytes | str):
        data = _parse(kind, raw)
        tag = data.get("type") if isinstance(data, dict) else data
        # A forged tag may be any JSON value, lists and objects included: only
        # a string can name a message type (and a list cannot even be looked up).
        if not isinstance(tag, str) or tag not in registry:
            raise MessageError(f"unknown {kind} type {tag!r}")
        return _build(registry[data.pop("type")], data)

    return write, read


_HINTS: dict[type, dict] = {}


def _type_hints(cls) -> dict:
    """``typing.get_type_hints(cls)``, once per class: it cost most of a message's read
    (tens of microseconds), which the controller pays per worker every health check."""
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls)
    return hints


def _build(cls, data):
    return _builder(cls)(data)


# What reads a message: one function per message class and per field type, made at the
# first read of it. Each read used to ask typing for every field's options again and format
# every field's place in the message for an error it would not raise: the controller reads a
# report per survivor in a recovery (90 us a FailureReport here, against 9 us to parse it).
_BUILDERS: dict[type, typing.Callable] = {}
_CHECKERS: dict = {}


def _builder(cls) -> typing.Callable:
    """``build(data) -> cls``: raises ``MessageError`` naming the bad field."""
    build = _BUILDERS.get(cls)
    if build is not None:
        return build
    name_of = cls.__name__
    # each field's check and its place, for an error
    checks = {name: (_checker(hint), (name_of, name))
              for name, hint in _type_hints(cls).items()}

    def build(data):
        if not isinstance(data, dict):
            raise MessageError(f"{name_of}: expected an object, got {data!r}")
        values = {}
        for name, value in data.items():
            field = checks.get(name)
            if field is None:
                unknown = sorted(set(data) - set(checks))
                raise MessageError(f"{name_of}: unknown field(s) {unknown}")
            values[name] = field[0](value, field[1])
        try:
            return cls(**values)
        except TypeError as exc:
            raise MessageError(f"{name_of}: {exc}") from exc

    _BUILDERS[cls] = build
    return build


def _where(path: tuple) -> str:
    """A value's place in a message, formatted only for an error: ``(class, field)``, or
    ``(parent, part)`` with part a list index, a dict key, or None for a dict's key itself."""
    if isinstance(path[0], str):
        return f"{path[0]}.{path[1]}"
    parent, part = path
    if part is None:
        return f"{_where(parent)} key"
    return f"{_where(parent)}[{part}]" if isinstance(part, int) else \
        f"{_where(parent)}[{part!r}]"


def _checker(hint) -> typing.Callable:
    """``check(value, path)``: ``value`` as ``hint`` says: int, float, str, bool, ``list[X]``,
    ``dict[str, X]``, a message dataclass, ``typing.Any`` (any JSON value), or a union of
    these (with None); ``path`` names its place for the error (``_where``)."""
    check = _CHECKERS.get(hint)
    if check is None:
        check = _CHECKERS[hint] = _shortcut(hint, _make_checker(hint))
    return check


def _shortcut(hint, check) -> typing.Callable:
    """``check``, first trying the common case directly: a value of the exact type ``hint``
    names (or None where it allows None), which ``check`` would return as it is (a float
    as a float, an int as an int: JSON gives no subclasses but bool, which ``int`` refuses
    either way), and a message dataclass's object, built by its builder, looked up once.
    Anything else goes to ``check``, with the same result and the same errors. Reading a
    host's ``HostPerf`` (8 workers' windows) spent most of its time in the general path."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    nullable = type(None) in options
    rest = [o for o in options if o is not type(None)]
    if len(rest) != 1:
        return check
    (opt,) = rest
    if opt in (int, float, str, bool):
        def simple(value, path, exact=opt):
            if type(value) is exact or (value is None and nullable):
                return value
            return check(value, path)
        return simple
    if dataclasses.is_dataclass(opt):
        built: list = []      # its builder, looked up at the first value (it may be this one)

        def message(value, path):
            if type(value) is dict:
                if not built:
                    built.append(_builder(opt))
                return built[0](value)
            if value is None and nullable:
                return None
            return check(value, path)
        return message
    origin = typing.get_origin(opt)
    if origin in (list, dict):
        convert = _list_of(typing.get_args(opt)[0]) if origin is list else \
            _dict_of(typing.get_args(opt)[1])

        def container(value, path):
            if type(value) is origin:
                return convert(value, path)
            if value is None and nullable:
                return None
            return check(value, path)
        return container
    return check


def _make_checker(hint) -> typing.Callable:
    if hint is typing.Any:
        return lambda value, path: value
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    nullable = type(None) in options
    tests = []   # (accepts(value), convert(value, path) or None: as is), the union's order
    for opt in options:
        origin = typing.get_origin(opt)
        if opt is int:
            tests.append((lambda v: isinstance(v, int) and not isinstance(v, bool), None))
        elif opt is float:
            tests.append((lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
                          lambda v, path: float(v)))
        elif opt in (str, bool):
            tests.append((lambda v, opt=opt: isinstance(v, opt), None))
        elif origin is list:
            (item,) = typing.get_args(opt)
            tests.append((lambda v: isinstance(v, list), _list_of(item)))
        elif origin is dict:
            _, item = typing.get_args(opt)
            tests.append((lambda v: isinstance(v, dict), _dict_of(item)))
        elif dataclasses.is_dataclass(opt):
            tests.append((lambda v: isinstance(v, dict),
                          lambda v, path, opt=opt: _builder(opt)(v)))

    def check(value, path):
        for accepts, convert in tests:     # none accepts None
            if accepts(value):
                return value if convert is None else convert(value, path)
        if value is None:
            if nullable:
                return None
            raise MessageError(f"{_where(path)} may not be null")
        raise MessageError(f"{_where(path)}: {value!r} is not a {hint}")

    return check


def _list_of(item_hint) -> typing.Callable:
    def convert(value: list, path: tuple) -> list:
        item = _checker(item_hint)
        return [item(v, (path, i)) for i, v in enumerate(value)]
    return convert


def _dict_of(item_hint) -> typing.Callable:
    def convert(value: dict, path: tuple) -> dict:
        key, item = _checker(str), _checker(item_hint)
        return {key(k, (path, None)): item(v, (path, k)) for k, v in value.items()}
    return convert


# --- commands: the controller's orders to one worker ----------------------------------------
@dataclass(frozen=True)
class Prepare:
    """To a stayer of a migration: build these groups' next generation (phase 1)."""

    migration_id: int
    groups: dict[str, int]
    naive: bool = False


@dataclass(frozen=True)
class Leave:
    """To a leaver: build the channel to the joiner, hand the role over at the switch."""

    migration_id: int
    joiner: str
    transfer_group: str
    transfer_generation: int
    naive: bool = False


@dataclass(frozen=True)
class AssignMigration:
    """To a standby: take ``role`` from ``leaver`` in a migration."""

    migration_id: int
    role: str
    epoch: int
    leaver: str
    transfer_group: str
    transfer_generation: int
    groups: dict[str, int]
    naive: bool = False


@dataclass(frozen=True)
class StateSource:
    """Where a recovery joiner's state comes from: a live replica over a channel, or the
    peer snapshot (held at ``address``) or the checkpoint taken before ``step``."""

    kind: str                           # "replica" | "snapshot" | "checkpoint"
    transfer_group: str | None = None
    transfer_generation: int | None = None
    step: int | None = None
    address: str | None = None          # "snapshot": the holder, host:port
    # "replica", striped: the channels from the further replicas, share 1 on (share 0
    # comes on ``transfer_group``; all at ``transfer_generation``)
    more_groups: list[str] | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("replica", "snapshot", "checkpoint"):
            raise MessageError(f"state source kind {self.kind!r}")


@dataclass(frozen=True)
class AssignRecovery:
    """To a standby: take a failed worker's ``role`` and resume at ``resume_step``."""

    recovery_id: int
    role: str
    epoch: int
    resume_step: int
    groups: dict[str, int]
    source: StateSource


@dataclass(frozen=True)
class SendState:
    """To a live replica of a failed role: send the state to its joiner (share ``part`` of
    ``parts``: a striped recovery takes a share from each of several replicas)."""

    joiner: str
    transfer_group: str
    transfer_generation: int
    part: int = 0
    parts: int = 1


@dataclass(frozen=True)
class Recover:
    """To a survivor: rebuild ``groups``, roll back to ``rollback_step`` if given (from the
    peer snapshot held at ``rollback_from``, else from the checkpoint), send state if asked,
    and resume at ``resume_step`` in ``epoch``."""

    recovery_id: int
    epoch: int
    resume_step: int
    rollback_step: int | None
    groups: dict[str, int]
    send_states: list[SendState] | None = None   # one per joiner this replica serves
    rollback_from: str | None = None


PERF_HISTORY = 8   # windows in StepPerf.recent


@dataclass(frozen=True)
class PerfWindow:
    first_step: int
    last_step: int
    compute_s: float                 # median over the window's steps


@dataclass(frozen=True)
class StepPerf:
    """A worker's newest window of committed steps (medians), for the straggler detector,
    sent to its agent every window, which publishes its host's (``HostPerf``). ``recent``
    repeats the compute medians of its last ``PERF_HISTORY`` windows in this role (oldest
    first, this one last), so a controller that reads less often than a window passes
    misses none."""

    role: str
    first_step: int
    last_step: int
    tenure_start: int                # the first step this process trained in this role
    step_s: float
    compute_s: float                 # step time minus the time blocked in its groups
    wait_s: dict[str, float]         # time blocked per group slot (tp, dp, pp_prev, ...)
    load1: float | None = None       # the host's 1-minute load average
    steal: float | None = None       # share of CPU time stolen by the hypervisor
    recent: list[PerfWindow] = dataclasses.field(default_factory=list)
    gpu_clock_mhz: float | None = None   # the GPU's SM clock (a throttled GPU runs slower)
    gpu_temp_c: float | None = None


@dataclass(frozen=True)
class Stop:
    """To every worker: stop gracefully at the step agreed under ``stop_id`` (a few steps
    ahead): write the checkpoint taken before it, then exit."""

    stop_id: int


COMMANDS = {"prepare": Prepare, "leave": Leave, "assign_migration": AssignMigration,
            "assign_recovery": AssignRecovery, "recover": Recover, "stop": Stop}
Command = Prepare | Leave | AssignMigration | AssignRecovery | Recover | Stop
encode_command, decode_command = _tagged(COMMANDS, "command")


# --- reports: what workers tell the controller -----------------------------------------------

STANDBY_STATES = ("cold", "warming", "warm", "refused")


@dataclass(frozen=True)
class StandbyReport:
    """``standby/<w>/state``: a free standby's readiness, the stage structures it rehearsed,
    and why it refused to serve (the script broke a rule the runtime relies on)."""

    state: str
    warm_for: list[str] = dataclasses.field(default_factory=list)
    reason: str = ""

    def __post_init__(self) -> None:
        if self.state not in STANDBY_STATES:
            raise MessageError(f"standby state {self.state!r} is not one of {STANDBY_STATES}")


@dataclass(frozen=True)
class FailureReport:
    """``fail/<epoch>/<w>``: a worker's own account of a failed step: the error it saw,
    whether its own communicator failed (then it is fenced and replaced), and each group's
    operation accounting (``decisions.dirty_groups``)."""

    step: int
    error: str
    self_failed: bool
    accounting: dict[str, dict[str, int]]


@dataclass(frozen=True)
class HostReports:
    """``agent/<node>/reports/<epoch>``: the failure reports (``FailureReport``) of the
    host's processes in ``epoch``, which each sent its agent on its channel (a process names
    only itself); the agent writes them as one value when every running process of the
    host reported, or shortly after the first (rewritten with any that come later), and
    adds their number to the epoch's report count. At 16K workers one report a worker was
    32K requests to the job's one store in every recovery (1.6 s of its thread)."""

    epoch: int
    reports: dict[str, FailureReport] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class HostRecovered:
    """``agent/<node>/recovered/<id>``: the processes of the host that are done with their
    part of recovery ``<id>`` (each sent its agent ``r <id>`` on its channel), written
    before the agent adds their number to the recovery's count. The count only tells the
    controller when to look: a recovery is done once the notes name every participant, so
    an add to the count by anyone else ends nothing early."""

    recovery_id: int
    processes: list[str] = dataclasses.field(default_factory=list)


@dataclass(frozen=True)
class ReadyReport:
    """``mig/<id>/ready/<w>``: a participant finished phase 1 (its next groups are built;
    for a joiner, its script also registered its state)."""

    build_s: float
    step: int | None = None           # a stayer's or leaver's step when it got ready
    prepare_s: float | None = None    # a joiner's whole preparation


@dataclass(frozen=True)
class SwitchReport:
    """``mig/<id>/switched/<w>``: a participant's account of the switch. Which fields are
    set depends on its part: leaver (transfer), stayer (install), joiner (receive, first
    step)."""

    switch_s: float = 0.0
    wait_boundary_s: float = 0.0
    build_s: float = 0.0
    install_s: float = 0.0
    transfer_s: float = 0.0
    transfer_bytes: int = 0
    recv_s: float = 0.0
    prepare_s: float = 0.0
    first_step_s: float = 0.0
    rss_before: dict[str, float] | None = None
    rss_after: dict[str, float] | None = None
    # with pre-copy (``migration.precopy``): bytes of state sent before the switch and of
    # gradients for the joiner's replay, optimizer steps replayed, the leaver's waits for
    # the joiner, whether it gave the pre-copy up; the joiner's time in the pre-copy
    precopy_bytes: int = 0
    precopy_grad_bytes: int = 0
    precopy_steps: int = 0
    precopy_wait_s: float = 0.0
    precopy_abandoned: bool = False
    precopy_s: float = 0.0
    # the joiner: the switch's transfer after the pre-copy, and how long it had waited for
    # the leaver's switch after its last replay (None: it replayed nothing)
    switch_recv_s: float = 0.0
    precopy_slack_s: float | None = None


# A planned migration's downtime is measured on every stayer from its own step-end times:
# the steps from the switch step through DOWNTIME_STEPS_AFTER more (a stall that spills into
# the steps after the switch, such as a joiner's slow first backward, is counted) against
# DOWNTIME_BASELINE_STEPS normal steps that ended before the stayer began phase 1.
DOWNTIME_STEPS_AFTER = 2
DOWNTIME_BASELINE_STEPS = 5
STEP_END_HISTORY = 1024   # step-end times a worker keeps (phase 1 must fit in them)


@dataclass(frozen=True)
class StepEnds:
    """``mig/<id>/steps/<w>``: when each step from ``first_step`` on ended on a stayer
    (``ends``, wall clock, one per step through ``switch_step + DOWNTIME_STEPS_AFTER``);
    ``prepare_step`` is the step at whose boundary it began phase 1."""

    first_step: int
    prepare_step: int
    switch_step: int
    ends: list[float]


@dataclass(frozen=True)
class MigrationAsk:
    """``req/<n>``: a migration asked for from outside the job (``trainmover migrate``,
    ``drain``, the dashboard: ``source``)."""

    workers: list[str]
    to: list[str] | None = None
    source: str = "cli"


@dataclass(frozen=True)
class StopAsk:
    """``stop/request``: a graceful stop asked for from outside the job (``trainmover
    stop``)."""

    reason: str = "trainmover stop"


# --- the agent's requests and records ----------------------------------------------------------

AGENT_SIGNALS = ("KILL", "TERM", "STOP", "CONT")


PROCESS_NAME = re.compile(r"[a-z][a-z0-9_-]{0,31}")


@dataclass(frozen=True)
class AgentSpawn:
    """Start incarnation ``incarnation`` of process ``name``: a worker, or a standby, of the
    agent's job (a later incarnation replaces an earlier one; a replayed request for one
    already started is a no-op). No program, path or environment is taken from the store:
    the agent builds the command line of its own worker entry point from these fields."""

    name: str
    incarnation: int
    standby: bool = False
    gpu: int | None = None              # the host's GPU (LOCAL_RANK) on device "cuda"
    # a restarted worker (the restart baseline): the checkpoint to load, its groups'
    # generation and its vote epoch
    resume_step: int | None = None
    generation: int | None = None
    epoch: int | None = None

    def __post_init__(self) -> None:
        if not PROCESS_NAME.fullmatch(self.name):
            raise MessageError(f"process name {self.name!r} is not {PROCESS_NAME.pattern}")
        for field_ in ("incarnation", "gpu", "resume_step", "generation", "epoch"):
            value = getattr(self, field_)
            if value is not None and value < 0:
                raise MessageError(f"AgentSpawn.{field_} {value} is negative")

    def worker_args(self) -> list[str]:
        """The worker entry point's own options for this process."""
        out = []
        for flag, value in (("--resume-step", self.resume_step),
                            ("--generation", self.generation), ("--epoch", self.epoch)):
            if value is not None:
                out += [flag, str(value)]
        return out + (["--standby"] if self.standby else [])


@dataclass(frozen=True)
class AgentSignal:
    """Signal one incarnation of a process; TERM is followed by KILL after ``grace_s``."""

    name: str
    incarnation: int
    signal: str
    grace_s: float = 0.0

    def __post_init__(self) -> None:
        if self.signal not in AGENT_SIGNALS:
            raise MessageError(f"signal {self.signal!r} is not one of {AGENT_SIGNALS}")


@dataclass(frozen=True)
class AgentShutdown:
    """Stop every process (KILL after ``grace_s``) and exit."""

    grace_s: float


@dataclass(frozen=True)
class AgentNoop:
    """Fills a request number taken by a controller that died before writing it."""


AGENT_REQUESTS = {"spawn": AgentSpawn, "signal": AgentSignal, "shutdown": AgentShutdown,
                  "noop": AgentNoop}
AgentRequest = AgentSpawn | AgentSignal | AgentShutdown | AgentNoop
encode_agent_request, decode_agent_request = _tagged(AGENT_REQUESTS, "agent request")


@dataclass(frozen=True)
class HostCommands:
    """``agent/<node>/cmd/<n>``: the commands of one controller round to processes of one
    host, in order, each ``[process name, the command as encode_command wrote it]``."""

    commands: list[list[str]]

    def __post_init__(self) -> None:
        for item in self.commands:
            if len(item) != 2 or not PROCESS_NAME.fullmatch(item[0]):
                raise MessageError(f"HostCommands entry {str(item)[:80]!r} is not "
                                   f"[process name, command]")
            if len(item[1]) > COMMAND_CHANNEL_MAX - 2:
                raise MessageError(f"a command to {item[0]} of {len(item[1])} bytes exceeds "
                                   f"{COMMAND_CHANNEL_MAX - 2}")


@dataclass(frozen=True)
class ProcRecord:
    """``agent/proc/<name>``: the PID of the process's current incarnation."""

    pid: int
    incarnation: int


@dataclass(frozen=True)
class ExitRecord:
    """``agent/exit/<n>``: one process exit."""

    name: str
    incarnation: int
    code: int
    time: float


AGENT_CHANNEL_ENV = "TRAINMOVER_AGENT_FD"
"""The descriptor of a process's channel to its host's agent (one end of a Unix socket pair
the agent made for it and passed at its start): its heartbeat beats there, and it votes on
each step there and hears the step's decision back (``agent/votes.py``).

The channel's messages, one datagram each (no signature: only the process and its agent
hold the pair): ``b"b"`` a beat; ``v <epoch> <step> <voter>`` a vote to commit the step;
``d <epoch> <step> <commit|abort>`` the step's decision, agent to process; ``w <epoch>`` the
process asks to hear of the epoch's abort, and ``a <epoch> <reason>`` is that abort, agent
to process (``agent/aborts.py``); ``c <command>`` a command of the controller's, agent to
process (``agent/commands.py``); ``p <StepPerf>`` a window's step measurements, process to
agent (``agent/perfs.py``)."""

CHANNEL_BEAT = b"b"
CHANNEL_MAX = 4096           # what a process sends its agent (a StepPerf at most)


def perf_message(perf: StepPerf) -> bytes:
    """A ``p <StepPerf>`` message; ``MessageError`` if it is over ``CHANNEL_MAX``."""
    raw = b"p " + write_message(perf).encode()
    if len(raw) > CHANNEL_MAX:
        raise MessageError(f"StepPerf: {len(raw)} bytes, over the channel's {CHANNEL_MAX}")
    return raw


def read_perf_message(raw: bytes) -> bytes | None:
    """The StepPerf of a ``p <StepPerf>`` message (undecoded), None for anything else."""
    return raw[2:] if raw[:2] == b"p " else None


def report_message(epoch: int, report: FailureReport) -> bytes:
    """An ``f <epoch> <FailureReport>`` message; ``MessageError`` if over ``CHANNEL_MAX``."""
    raw = b"f %d " % epoch + write_message(report).encode()
    if len(raw) > CHANNEL_MAX:
        raise MessageError(f"FailureReport: {len(raw)} bytes, over the channel's "
                           f"{CHANNEL_MAX}")
    return raw


def read_report_message(raw: bytes) -> tuple[int, bytes] | None:
    """``(epoch, FailureReport undecoded)`` of an ``f`` message, None for anything else."""
    if raw[:2] != b"f ":
        return None
    head, sep, payload = raw[2:].partition(b" ")
    if not sep or not head.isdigit() or len(head) > 18:
        return None
    return int(head), payload


def recovered_message(recovery_id: int) -> bytes:
    return b"r %d" % recovery_id


def read_recovered_message(raw: bytes) -> int | None:
    """The recovery id of an ``r <recovery id>`` message, None for anything else."""
    kind, _, rid = raw.partition(b" ")
    if kind != b"r" or not rid.isdigit() or len(rid) > 18:
        return None
    return int(rid)


COMMAND_CHANNEL_MAX = 1 << 16    # what an agent sends a process (a command at most)


def command_message(command: str) -> bytes:
    return b"c " + command.encode()


def read_command_message(raw: bytes) -> bytes | None:
    """The command of a ``c <command>`` message, None for anything else."""
    return raw[2:] if raw[:2] == b"c " else None
ABORT_REASON_MAX = 200       # an abort's reason, cut to fit a channel message


def watch_message(epoch: int) -> bytes:
    return f"w {epoch}".encode()


def read_watch_message(raw: bytes) -> int | None:
    """The epoch of a ``w <epoch>`` message, None for anything else."""
    kind, _, epoch = raw.partition(b" ")
    if kind != b"w" or not epoch.isdigit():
        return None
    return int(epoch)


def abort_message(epoch: int, reason: str) -> bytes:
    return f"a {epoch} ".encode() + reason.encode()[:ABORT_REASON_MAX]


def read_abort_message(raw: bytes) -> tuple[int, str] | None:
    """``(epoch, reason)`` of an ``a <epoch> <reason>`` message, None for anything else."""
    parts = raw.split(b" ", 2)
    if len(parts) != 3 or parts[0] != b"a" or not parts[1].isdigit():
        return None
    return int(parts[1]), parts[2].decode(errors="replace")


def vote_message(epoch: int, step: int, voter: str) -> bytes:
    return f"v {epoch} {step} {voter}".encode()


def decision_message(epoch: int, step: int, decision: bytes) -> bytes:
    return f"d {epoch} {step} ".encode() + decision


def read_channel_message(raw: bytes) -> tuple[str, int, int, str] | None:
    """A vote or a decision as ``(kind, epoch, step, voter or decision)``, None for
    anything else (a beat, junk)."""
    parts = raw.split(b" ")
    if len(parts) != 4 or parts[0] not in (b"v", b"d"):
        return None
    try:
        return parts[0].decode(), int(parts[1]), int(parts[2]), parts[3].decode()
    except (ValueError, UnicodeDecodeError):
        return None


@dataclass(frozen=True)
class HostBeat:
    """``agent/<node>/hb``: a host's heartbeat, which its agent overwrites every heartbeat
    interval: its own ``seq`` and PID (as a ``Beat``), how many of its processes are
    ``running``, and ``quiet``: the running processes its agent did not hear from lately
    (``HealthConfig.quiet_listed_s``), each ``[pid, ms]``: how long it has been silent on
    its channel to the agent (``worker/liveness.Heartbeat``), -1 before its first beat. A
    process left out beat within that time. So the host's value, and the controller's work
    on it, stay the size of a host's silence, not of its processes: the controller judges
    the processes listed, not every worker at every look. A process is alive while it is
    left out, or while its ``ms`` is small, whoever writes the store: a process cannot beat
    for another (each channel is its own, inherited from the agent).

    A signed value, not a counter (anyone who reaches the store can bump a counter, which
    once kept a stopped worker looking alive): a reader takes a host's value only when a
    genuine value's ``seq`` moved past the one it saw last, so junk reads as no beat and an
    old genuine value put back is none either."""

    seq: int
    pid: int
    running: int = 0
    quiet: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    perf: int = 0       # the ``seq`` of the host's newest ``HostPerf`` (0: none yet)


@dataclass(frozen=True)
class HostPerf:
    """``agent/<node>/perf``: the newest window of step measurements of each of the host's
    running processes that sent one (``StepPerf``, on its channel), which its agent writes
    with a new ``seq`` when one came, at most once a heartbeat interval, before the beat
    that announces it (``HostBeat.perf``). The controller reads the hosts whose announced
    ``seq`` moved, one key a host a window, where a key a worker read every half second
    was 200K reads a second through the store at 100K workers. A process names only
    itself (its channel is its own)."""

    seq: int
    workers: dict[str, StepPerf] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class ControllerInfo:
    """``controller/current``: the live controller (the agent of its host restarts it when
    its PID is gone; a new one increments the incarnation and the old one steps down).
    ``node``: the host it runs on (host 0 but after a takeover, which the store on etcd
    allows)."""

    pid: int
    incarnation: int
    node: int = 0


@dataclass(frozen=True)
class AgentInfo:
    """``agent/<node>/info``: the host's agent is serving, at this address."""

    pid: int
    node: int
    address: str
