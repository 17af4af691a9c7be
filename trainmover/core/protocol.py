"""The store keys and messages shared by the coordinator and the workers. Pure (no torch):
everything that crosses a process boundary is named here, once.

Commands are JSON objects appended to a per-worker list (``cmd/<worker>/<n>``, numbered by
the controller, so a resumed controller re-sending one writes the same key twice, never two
commands); a worker's command thread waits on the next index, so checking for a command costs
the training loop one ``queue.Queue`` look-up per step.
"""
from __future__ import annotations

import dataclasses
import json
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


def command_key(worker: str, index: int) -> str:
    return f"cmd/{worker}/{index}"


def standby_state_key(worker: str) -> str:
    return f"standby/{worker}/state"


def mig_key(migration_id: int, what: str, worker: str | None = None) -> str:
    base = f"mig/{migration_id}/{what}"
    return base if worker is None else f"{base}/{worker}"


def request_key(index: int, what: str = "") -> str:
    return f"req/{index}" + (f"/{what}" if what else "")


def heartbeat_key(worker: str, pid: int) -> str:
    """Per process, not per name: a killed incarnation's last beats never count for the
    fresh process that took its name."""
    return f"hb/{worker}/{pid}"


def finished_key(worker: str) -> str:
    """Set by a worker that completed the job: its heartbeat may stop from then on."""
    return f"finished/{worker}"


def abort_key(epoch: int) -> str:
    """Written by the controller to abandon the step in flight of ``epoch``."""
    return f"abort/{epoch}"


def commit_key(epoch: int, step: int, what: str) -> str:
    return f"commit/{epoch}/{step}/{what}"


def failure_key(epoch: int, worker: str) -> str:
    """A worker's own report of a failed step (the error it saw, its groups' accounting)."""
    return f"fail/{epoch}/{worker}"


def recovery_key(recovery_id: int, what: str, worker: str | None = None) -> str:
    base = f"recovery/{recovery_id}/{what}"
    return base if worker is None else f"{base}/{worker}"


def checkpoint_key(epoch: int, step: int) -> str:
    """Counts the roles that finished writing, in ``epoch``, the checkpoint taken before
    ``step``."""
    return f"ckpt/{epoch}/{step}/written"


REQUEST_COUNT_KEY = "req/count"
MIGRATION_COUNT_KEY = "mig/count"


def encode(obj) -> str:
    return json.dumps(obj, sort_keys=True)


def decode(raw: bytes | str):
    return json.loads(raw.decode() if isinstance(raw, bytes) else raw)




# --- the agent (store host and process supervisor) and the controller's registration -----

AGENT_REQUEST_COUNT_KEY = "agent/req/count"
AGENT_EXIT_COUNT_KEY = "agent/exit/count"
AGENT_READY_KEY = "agent/ready"
AGENT_DONE_KEY = "agent/done"
AGENT_DONE_ACK_KEY = "agent/done_ack"
CONTROLLER_KEY = "controller/current"            # {"pid", "incarnation"} of the live one
CONTROLLER_INCARNATION_KEY = "controller/incarnation"
CONTROLLER_SNAPSHOT_KEY = "controller/snapshot"  # the controller's state, for a resume


def agent_request_key(index: int) -> str:
    return f"agent/req/{index}"


def agent_proc_key(name: str) -> str:
    return f"agent/proc/{name}"


def agent_exit_key(index: int) -> str:
    return f"agent/exit/{index}"


def standby_refused_key(worker: str) -> str:
    """Why a standby refused to serve (the job's script broke a rule the runtime relies on)."""
    return f"standby/{worker}/refused"


def final_shards_key() -> str:
    """Counts the data-parallel-rank-0 roles that wrote their final state."""
    return "final/shards"


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


# --- commands: the controller's orders to one worker ----------------------------------------
# Dataclasses written as JSON (``{"type": ..., fields}``) and validated when read: an unknown
# type or field, a field of the wrong type or an oversized message is refused (the worker logs
# it and goes on), never half-obeyed.

MAX_MESSAGE_BYTES = 256 * 1024


class MessageError(ValueError):
    """A message that is not one the protocol defines."""


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
    checkpoint taken before ``step``."""

    kind: str                           # "replica" | "checkpoint"
    transfer_group: str | None = None
    transfer_generation: int | None = None
    step: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("replica", "checkpoint"):
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
    """To the live replica of a failed role: send the state to its joiner."""

    joiner: str
    transfer_group: str
    transfer_generation: int


@dataclass(frozen=True)
class Recover:
    """To a survivor: rebuild ``groups``, roll back to ``rollback_step`` if given, send state
    if asked, and resume at ``resume_step`` in ``epoch``."""

    recovery_id: int
    epoch: int
    resume_step: int
    rollback_step: int | None
    groups: dict[str, int]
    send_state: SendState | None = None


COMMANDS = {"prepare": Prepare, "leave": Leave, "assign_migration": AssignMigration,
            "assign_recovery": AssignRecovery, "recover": Recover}
_COMMAND_NAMES = {cls: name for name, cls in COMMANDS.items()}
Command = Prepare | Leave | AssignMigration | AssignRecovery | Recover


def encode_command(cmd: Command) -> str:
    return json.dumps({"type": _COMMAND_NAMES[type(cmd)], **dataclasses.asdict(cmd)},
                      sort_keys=True)


def decode_command(raw: bytes | str) -> Command:
    if len(raw) > MAX_MESSAGE_BYTES:
        raise MessageError(f"command of {len(raw)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise MessageError(f"command is not JSON: {exc}") from exc
    if not isinstance(data, dict) or data.get("type") not in COMMANDS:
        raise MessageError(f"unknown command type "
                           f"{data.get('type') if isinstance(data, dict) else data!r}")
    cls = COMMANDS[data.pop("type")]
    return _build(cls, data)


def _build(cls, data):
    if not isinstance(data, dict):
        raise MessageError(f"{cls.__name__}: expected an object, got {data!r}")
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(data) - set(hints))
    if unknown:
        raise MessageError(f"{cls.__name__}: unknown field(s) {unknown}")
    values = {name: _check(f"{cls.__name__}.{name}", hints[name], value)
              for name, value in data.items()}
    try:
        return cls(**values)
    except TypeError as exc:
        raise MessageError(f"{cls.__name__}: {exc}") from exc


def _check(where: str, hint, value):
    """``value`` as ``hint`` says: int, str, bool, dict[str, int], a message dataclass, or
    any of these or None."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None:
        if type(None) in options:
            return None
        raise MessageError(f"{where} may not be null")
    for opt in options:
        if opt is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if opt in (str, bool) and isinstance(value, opt):
            return value
        if typing.get_origin(opt) is dict and isinstance(value, dict) and all(
                isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
                for k, v in value.items()):
            return value
        if dataclasses.is_dataclass(opt) and isinstance(value, dict):
            return _build(opt, value)
    raise MessageError(f"{where}: {value!r} is not a {hint}")
