"""The store's keys: every one the job's processes use, named here once."""
from __future__ import annotations

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
    "votes": "host:port of the store of the vote group the host leads (agent/groupvote.py)",
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
