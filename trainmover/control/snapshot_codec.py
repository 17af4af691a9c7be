"""The controller's snapshot codec: the classes a snapshot in the store may hold (and a
resumed controller or ``trainmover status`` may rebuild), nothing else (``core/codec.py``).
Apart from the coordinator, so a reader of snapshots needs no controller.

Where a snapshot is kept: at ``controller/snapshot`` in the store, and in the run dir
(``controller.snapshot``, replaced atomically, opened without following a symlink), both
written in the same save. Each copy is signed with the run's key and carries the save's
number (``frame``): whoever reaches the store can write junk over its copy, or put back an
older genuine one, but not into the run dir (the job's user's alone), so a reader takes the
newest genuine copy of the two (``read_newest``) and junk at the key costs nothing.

A large table (at least ``controller.snapshot_part_min_bytes`` of JSON: the membership and
process tables from a few hundred workers) is kept as parts, each under its digest: in the
store at ``controller/snapshot_part/<whose>/<digest>`` (signed like every value), in the
run dir in ``controller.snapshot.parts/<whose>-<digest>`` (whose: a name each controller
draws for its own parts, in its snapshots' frame); the snapshot names them. A save writes
the parts a copy does not hold yet, then the snapshot, then deletes the parts of its own
that neither this save nor the one before names (a reader that read the previous snapshot
still finds its parts); a resumed controller deletes the parts of the snapshot it read a
while after it took over, once its predecessor has stepped down (``Saver.adopt``). A busy
round at 16K workers writes the few parts it changed instead of 4.8 MB twice. A part is
checked against its digest when read, so a part that is not what the (signed) snapshot
names is refused like junk.
"""
from __future__ import annotations

import os
import re
from typing import Callable

from trainmover.control.health import Failure
from trainmover.control.migrations import ActiveMigration, MigrationRequest
from trainmover.control.processes import AgentClient, ProcView
from trainmover.control.recovery import ActiveRecovery
from trainmover.core import decisions as C
from trainmover.core import protocol as P
from trainmover.core import rundir
from trainmover.core.auth import KEYS_PER_READ, read_valid, seal, unseal
from trainmover.core.codec import Codec, SnapshotError
from trainmover.core.faults import Inject
from trainmover.core.topology import Layout, Role

SNAPSHOT_CODEC = Codec(
    C.Membership, C.StandbyState, C.MigrationState, C.MigrationPlan, C.RecoveryPlan, C.Pair,
    Role, Layout, MigrationRequest, ActiveMigration, ActiveRecovery, Failure, Inject,
    AgentClient, ProcView, P.AgentSpawn, P.FailureReport)

SNAPSHOT_FILE = "controller.snapshot"
PARTS_DIR = "controller.snapshot.parts"
# Each controller writes the parts of its saves under a name of its own (``Saver``): a
# superseded controller still saving for a moment, or a successor, never deletes a part the
# other's snapshots name.
_OWNER = re.compile(rb"[0-9a-f]{0,16}")
# what the file's MAC covers besides its content: no store key, so a value signed for the
# store is no valid file and the reverse
_FILE_MAC_KEY = f"file:{SNAPSHOT_FILE}"


def frame(seq: int, blob: str | bytes, parts_of: str = "") -> bytes:
    """A saved snapshot as both copies hold it: the save's number (each save of a run's
    controllers numbers one more), the controller whose parts it names (if any), a newline,
    the codec's JSON."""
    head = b"%d %s\n" % (seq, parts_of.encode()) if parts_of else b"%d\n" % seq
    return head + (blob.encode() if isinstance(blob, str) else blob)


def unframe(payload: bytes) -> tuple[int, str, bytes]:
    """``(save number, whose parts, JSON)`` of a framed snapshot; one saved without a number
    (an older version) counts as save 0."""
    if payload.startswith(b"{"):
        return 0, "", payload
    head, sep, blob = payload.partition(b"\n")
    seq, _, owner = head.partition(b" ")
    if not sep or not seq.isdigit() or len(seq) > 20 or not _OWNER.fullmatch(owner):
        raise SnapshotError("not a numbered snapshot")
    return int(seq), owner.decode(), blob


def file_path(run_dir: str) -> str:
    return os.path.join(run_dir, SNAPSHOT_FILE)


def parts_path(run_dir: str) -> str:
    return os.path.join(run_dir, PARTS_DIR)


def write_file(run_dir: str, run_key: bytes, payload: bytes) -> None:
    """The run dir's copy of a framed snapshot, signed, replacing the previous one at once."""
    rundir.write_atomic(file_path(run_dir), seal(run_key, _FILE_MAC_KEY, payload))


def part_key(owner: str, digest: str) -> str:
    return P.controller_snapshot_part_key(f"{owner}/{digest}")


def part_file(run_dir: str, owner: str, digest: str) -> str:
    return os.path.join(parts_path(run_dir), f"{owner}-{digest}")


class _Copy:
    """One copy's parts written by this controller (``owner``: its saves' name for them)."""

    def __init__(self, owner: str):
        self.owner = owner
        self.present: set[str] = set()

    def put_parts(self, parts: dict[str, str]) -> None:
        new = [d for d in parts if d not in self.present]
        if new:
            self._write(new, parts)
            self.present.update(new)

    def drop(self, keep: set[str]) -> None:
        stale = self.present - keep
        if stale:
            self.present -= stale
            self.delete([(self.owner, d) for d in sorted(stale)])


class StoreParts(_Copy):
    """The store's copy's parts (``store``: the controller's ``AuthStore``, when asked: a
    controller connects after it is built)."""

    def __init__(self, owner: str, store: Callable[[], object]):
        super().__init__(owner)
        self.store = store

    def _write(self, digests: list[str], parts: dict[str, str]) -> None:
        store = self.store()
        for i in range(0, len(digests), KEYS_PER_READ):
            batch = digests[i:i + KEYS_PER_READ]
            store.multi_set([part_key(self.owner, d) for d in batch], [parts[d] for d in batch])

    def delete(self, parts: list[tuple[str, str]]) -> None:
        # one request (a save at 4K workers replaced up to ~70 parts, a request each)
        self.store().delete_keys([part_key(owner, d) for owner, d in parts])


class FileParts(_Copy):
    """The run dir's copy's parts: a file each, replaced atomically like the snapshot's."""

    def __init__(self, owner: str, run_dir: str):
        super().__init__(owner)
        self.run_dir, self.dir = run_dir, parts_path(run_dir)

    def _write(self, digests: list[str], parts: dict[str, str]) -> None:
        try:
            os.mkdir(self.dir, 0o700)
        except FileExistsError:
            pass
        if not os.path.isdir(self.dir) or os.path.islink(self.dir):
            raise OSError(f"{self.dir!r} is not a folder")
        for d in digests:
            rundir.write_atomic(part_file(self.run_dir, self.owner, d), parts[d].encode())

    def delete(self, parts: list[tuple[str, str]]) -> None:
        for owner, d in parts:
            try:
                os.unlink(part_file(self.run_dir, owner, d))
            except OSError:
                pass                  # gone already (a folder removed by hand): nothing to do

    def lost(self) -> None:
        """The files could not be written: the next save writes every part again."""
        self.present.clear()


def _store_parts(store, owner: str):
    def fetch(digests: list[str]) -> dict[str, bytes]:
        keys = [part_key(owner, d) for d in digests]
        return {d: v for d, v in zip(digests, read_valid(store, keys)) if v is not None}
    return fetch


def _file_parts(run_dir: str, owner: str):
    def fetch(digests: list[str]) -> dict[str, bytes]:
        out = {}
        for d in digests:
            try:
                out[d] = rundir.read_bytes(part_file(run_dir, owner, d))
            except OSError:           # missing, or not this user's regular file: refused
                pass
        return out
    return fetch


def read_newest(run_dir: str, store, run_key: bytes,
                parts: set[tuple[str, str]] | None = None) -> tuple[int, dict, list[str]]:
    """The newest genuine snapshot of the run (``(save number, state, passed over)``; the
    last: why each copy that was not used was passed over: junk at the store's key, a file
    of another run, one that does not decode, a part missing). ``store``: an ``AuthStore``
    of the run (or a ``PlainStore``). ``parts``: filled with the parts the snapshot read
    names (``(whose, digest)``). Raises ``ValueError`` naming both copies' problems if
    neither is usable."""
    copies, why = [], []
    if store.check([P.CONTROLLER_SNAPSHOT_KEY]):
        try:
            copies.append(("the store's", unframe(store.get(P.CONTROLLER_SNAPSHOT_KEY)),
                           lambda owner: _store_parts(store, owner)))
        except ValueError as exc:        # AuthError, SnapshotError
            why.append(f"the store's copy: {exc}")
    else:
        why.append("the store's copy: none")
    try:
        raw = rundir.read_bytes(file_path(run_dir))
        copies.append(("the run dir's", unframe(unseal(run_key, _FILE_MAC_KEY, raw)),
                       lambda owner: _file_parts(run_dir, owner)))
    except FileNotFoundError:
        why.append(f"the run dir's copy: no {SNAPSHOT_FILE}")
    except (OSError, ValueError) as exc:  # UnsafeRunDir, AuthError (another run's), framing
        why.append(f"the run dir's copy: {exc}")
    # newest first; of two equal ones the store's (it was written last)
    copies.sort(key=lambda c: -c[1][0])
    for i, (name, (seq, owner, blob), source) in enumerate(copies):
        named: list[str] = []

        def fetch_named(digests: list[str], fetch=source(owner), named=named) -> dict:
            named += digests
            return fetch(digests)
        try:
            state = SNAPSHOT_CODEC.loads(blob, fetch_named)
        except ValueError as exc:
            why.append(f"{name} copy (save {seq}): {exc}")
            continue
        if parts is not None:
            parts.update((owner, d) for d in named)
        why += [f"{other} copy: save {older}, older"
                for other, (older, _, _), _ in copies[i + 1:] if older < seq]
        return seq, state, why
    raise ValueError("no usable controller snapshot (" + "; ".join(why) + ")")
