"""The controller's snapshot codec: the classes a snapshot in the store may hold (and a
resumed controller or ``trainmover status`` may rebuild), nothing else (``core/codec.py``).
Apart from the coordinator, so a reader of snapshots needs no controller.

Where a snapshot is kept: at ``controller/snapshot`` in the store, and in the run dir
(``controller.snapshot``, replaced atomically, opened without following a symlink), both
written in the same save. Each copy is signed with the run's key and carries the save's
number (``frame``): whoever reaches the store can write junk over its copy, or put back an
older genuine one, but not into the run dir (the job's user's alone), so a reader takes the
newest genuine copy of the two (``read_newest``) and junk at the key costs nothing."""
from __future__ import annotations

import os

from trainmover.control.health import Failure
from trainmover.control.migrations import ActiveMigration, MigrationRequest
from trainmover.control.processes import AgentClient, ProcView
from trainmover.control.recovery import ActiveRecovery
from trainmover.core import decisions as C
from trainmover.core import protocol as P
from trainmover.core import rundir
from trainmover.core.auth import seal, unseal
from trainmover.core.codec import Codec, SnapshotError
from trainmover.core.faults import Inject
from trainmover.core.topology import Layout, Role

SNAPSHOT_CODEC = Codec(
    C.Membership, C.StandbyState, C.MigrationState, C.MigrationPlan, C.RecoveryPlan, C.Pair,
    Role, Layout, MigrationRequest, ActiveMigration, ActiveRecovery, Failure, Inject,
    AgentClient, ProcView, P.AgentSpawn, P.FailureReport)

SNAPSHOT_FILE = "controller.snapshot"
# what the file's MAC covers besides its content: no store key, so a value signed for the
# store is no valid file and the reverse
_FILE_MAC_KEY = f"file:{SNAPSHOT_FILE}"


def frame(seq: int, blob: str | bytes) -> bytes:
    """A saved snapshot as both copies hold it: the save's number (each save of a run's
    controllers numbers one more), a newline, the codec's JSON."""
    return b"%d\n" % seq + (blob.encode() if isinstance(blob, str) else blob)


def unframe(payload: bytes) -> tuple[int, bytes]:
    """``(save number, JSON)`` of a framed snapshot; one saved without a number (an older
    version) counts as save 0."""
    if payload.startswith(b"{"):
        return 0, payload
    head, sep, blob = payload.partition(b"\n")
    if not sep or not head.isdigit() or len(head) > 20:
        raise SnapshotError("not a numbered snapshot")
    return int(head), blob


def file_path(run_dir: str) -> str:
    return os.path.join(run_dir, SNAPSHOT_FILE)


def write_file(run_dir: str, run_key: bytes, payload: bytes) -> None:
    """The run dir's copy of a framed snapshot, signed, replacing the previous one at once."""
    rundir.write_atomic(file_path(run_dir), seal(run_key, _FILE_MAC_KEY, payload))


def read_newest(run_dir: str, store, run_key: bytes) -> tuple[int, dict, list[str]]:
    """The newest genuine snapshot of the run (``(save number, state, passed over)``; the
    last: why each copy that was not used was passed over: junk at the store's key, a file
    of another run, one that does not decode). ``store``: an ``AuthStore`` of the run (or a
    ``PlainStore``). Raises ``ValueError`` naming both copies' problems if neither is
    usable."""
    copies, why = [], []
    if store.check([P.CONTROLLER_SNAPSHOT_KEY]):
        try:
            copies.append(("the store's", unframe(store.get(P.CONTROLLER_SNAPSHOT_KEY))))
        except ValueError as exc:        # AuthError, SnapshotError
            why.append(f"the store's copy: {exc}")
    else:
        why.append("the store's copy: none")
    try:
        raw = rundir.read_bytes(file_path(run_dir))
        copies.append(("the run dir's", unframe(unseal(run_key, _FILE_MAC_KEY, raw))))
    except FileNotFoundError:
        why.append(f"the run dir's copy: no {SNAPSHOT_FILE}")
    except (OSError, ValueError) as exc:  # UnsafeRunDir, AuthError (another run's), framing
        why.append(f"the run dir's copy: {exc}")
    # newest first; of two equal ones the store's (it was written last)
    copies.sort(key=lambda c: -c[1][0])
    for i, (name, (seq, blob)) in enumerate(copies):
        try:
            state = SNAPSHOT_CODEC.loads(blob)
        except ValueError as exc:
            why.append(f"{name} copy (save {seq}): {exc}")
            continue
        why += [f"{other} copy: save {older}, older" for other, (older, _) in copies[i + 1:]
                if older < seq]
        return seq, state, why
    raise ValueError("no usable controller snapshot (" + "; ".join(why) + ")")
