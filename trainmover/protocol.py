"""The store keys and messages shared by the coordinator and the workers. Pure (no torch):
everything that crosses a process boundary is named here, once.

Commands are JSON objects appended to a per-worker list (``cmd/<worker>/<n>``, numbered by
the controller, so a resumed controller re-sending one writes the same key twice, never two
commands); a worker's command thread waits on the next index, so checking for a command costs
the training loop one ``queue.Queue`` look-up per step.
"""
from __future__ import annotations

import json

SWITCH_MARGIN_STEPS = 3
"""How far ahead of the first participant's boundary the switch step is placed. Every
participant shares a group with the leaver that runs a blocking collective each step, so no
two participants are more than two boundaries apart; three is the smallest margin that no
participant can already have passed."""


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
