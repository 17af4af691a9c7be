"""The messages: the controller's commands, the workers' and agents' reports, requests and
records, each a frozen dataclass."""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from trainmover.core.protocol.codec import MessageError, _tagged

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
    32K requests to the job's one store in every recovery (1.6 s of its thread).

    ``silent``: the host's running processes that sent no report within
    ``recovery.report_timeout_s`` of the epoch's abort as the agent saw it (written again
    then): the controller fences those as hung on their agent's word, timed on the host,
    not by when the value reached it (a host's writes that lag the others' are no sign of
    a hung process)."""

    epoch: int
    reports: dict[str, FailureReport] = dataclasses.field(default_factory=dict)
    silent: list[str] = dataclasses.field(default_factory=list)


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


COMMAND_CHANNEL_MAX = 1 << 16    # what an agent sends a process (a command at most)


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
