"""The end of the controller's supervision round: its snapshot saved, then its outbox sent.

The order is the recovery's guarantee: whatever a round decided is in the saved snapshot
before any order of it reaches a process or agent, so a resumed controller finds the orders
its predecessor may have sent and sends them again (each is idempotent: keys set, numbered
messages at the same numbers). The snapshot is kept twice (``snapshot_codec``): in the store
and in the run dir. ``status.json`` (``trainmover status``) is written from the same state,
less often where it is large.
"""
from __future__ import annotations

import os
import secrets
import time
from typing import Callable

from trainmover.control import snapshot_codec
from trainmover.control.context import JobContext
from trainmover.control.retention import Retention
from trainmover.control.snapshot_codec import SNAPSHOT_CODEC
from trainmover.control.status_file import (STATUS_MAX_INTERVAL_S, status_columns,
                                            write_status_file)
from trainmover.core import protocol as P

SET_BATCH = 1024          # keys of the outbox a request (flush)
# the most command bytes in one host's message: half what a reader accepts of a message
# (P.MAX_MESSAGE_BYTES), the rest for the encoding's own
HOST_COMMANDS_BYTES = P.MAX_MESSAGE_BYTES // 2


def _parts(items: list[list[str]]) -> list[list[list[str]]]:
    """A host's commands of one round as messages of at most ``HOST_COMMANDS_BYTES``, in
    order (a command is at most ``P.COMMAND_CHANNEL_MAX``: each part holds one at least)."""
    parts, size = [[]], 0
    for item in items:
        cost = len(item[0]) + len(item[1]) + 8
        if parts[-1] and size + cost > HOST_COMMANDS_BYTES:
            parts.append([])
            size = 0
        parts[-1].append(item)
        size += cost
    return parts


# How long a resumed controller keeps its predecessor's snapshot parts, in the predecessor's
# checks for a newer controller (``Saver.adopt``).
ADOPTED_GRACE_CHECKS = 20

# The most of the controller's time status.json may take: beyond it the file is written less
# often than controller.status_interval_s (``flush``).
STATUS_CPU_SHARE = 0.05


class Saver:
    def __init__(self, ctx: JobContext, run_dir: str, state: Callable[[], dict],
                 retention: Retention, perf: Callable[[], dict]):
        """``state``: the controller's whole state, as saved; ``perf``: each role holder's
        newest step measurements as the status file shows them (``status_perf``)."""
        self.ctx, self.run_dir, self.state, self.retention = ctx, run_dir, state, retention
        self.perf = perf
        self.run_key: bytes | None = None   # set once the run began: nothing saved before
        self.saves = 0           # the number of the last snapshot saved (the run's count)
        self._saved: str | None = None
        self._file_failed = False
        # each copy's parts of the large tables (``snapshot_codec``), under this controller's
        # own name for them; the parts the save before the last named (kept: a reader of that
        # snapshot may be fetching them); a predecessor's, and when they may go
        self.parts_of = secrets.token_hex(8)
        self.store_parts = snapshot_codec.StoreParts(self.parts_of, lambda: ctx.store)
        self.file_parts = snapshot_codec.FileParts(self.parts_of, run_dir)
        self._named_before: set[str] = set()
        self._adopted: list[tuple[str, str]] = []
        self._adopted_until = 0.0
        self._saved_at = self._status_at = float("-inf")
        self._status_every = ctx.cfg.controller.status_interval_s

    def flush(self, force: bool, busy: bool) -> None:
        """Save the snapshot (if anything changed), then send the outbox.

        When the round sends nothing and no migration or recovery is in flight, the state
        can only have changed in what a resumed controller finds again by itself (steps
        committed, exits and standby readiness read again, keys deleted again), so the
        snapshot is then saved at most every ``controller.snapshot_interval_s``: encoding
        it every round was most of an idle controller's CPU. A busy round's save encodes
        again only what changed in the big tables (membership, processes, their hosts,
        reports: ``core.codec.Table``), not the whole state: 0.3 s a round at 16K
        workers before."""
        ctx = self.ctx
        now = time.monotonic()
        if force or busy or now - self._saved_at >= ctx.cfg.controller.snapshot_interval_s:
            self._saved_at = now
            exits_seen = ctx.procs.exits_seen
            state = self.state()
            parts: dict[str, str] = {}
            blob = SNAPSHOT_CODEC.dumps(state, parts, ctx.cfg.controller.snapshot_part_min_bytes)
            if now - self._status_at >= self._status_every:
                self._status_at = time.monotonic()
                self._write_status(state)
                # the file is O(N): where writing it takes more than STATUS_CPU_SHARE of the
                # controller's time it is written less often, and says so (the reader's
                # freshness follows it)
                self._status_every = max(ctx.cfg.controller.status_interval_s, min(
                    STATUS_MAX_INTERVAL_S,
                    (time.monotonic() - self._status_at) / STATUS_CPU_SHARE))
            if blob != self._saved:
                self.saves += 1
                payload = snapshot_codec.frame(self.saves, blob, self.parts_of if parts else "")
                self._save_file(payload, parts)   # first: of the two, the newer one counts
                self.store_parts.put_parts(parts)
                ctx.store.set(P.CONTROLLER_SNAPSHOT_KEY, payload)
                self._saved = blob
                keep = self._named_before | parts.keys()
                self.store_parts.drop(keep)
                self.file_parts.drop(keep)
                self._named_before = set(parts)
            if self._adopted and now >= self._adopted_until:
                self.store_parts.delete(self._adopted)
                self.file_parts.delete(self._adopted)
                self._adopted = []
            self.retention.snapshot_saved(exits_seen)
        if not ctx.outbox:
            return
        # consecutive keys go in requests of up to SET_BATCH, in order (a key set twice ends
        # with the later value): a recovery commands every worker, N / SET_BATCH requests to
        # the store instead of N
        keys: list[str] = []
        values: list[str] = []

        def send_keys() -> None:
            if keys:
                ctx.store.multi_set(keys, values)
                keys.clear()
                values.clear()

        # the processes' commands last, one message a host in the round's order: the keys
        # and processes they refer to are in place before any of them is read. Numbered here
        # from the snapshot's counters, so that a resumed controller sending this outbox
        # again writes the same messages at the same numbers
        commands: dict[int, list[list[str]]] = {}
        for item in ctx.outbox:
            if item[0] == "set":
                keys.append(item[1])
                values.append(item[2])
                if len(keys) == SET_BATCH:
                    send_keys()
            elif item[0] == "cmd":
                commands.setdefault(item[1], []).append([item[2], item[3]])
            else:
                send_keys()
                ctx.procs.send(item[1], item[2])
        for node, items in commands.items():
            for part in _parts(items):
                index = ctx.cmd_next.get(str(node), 1)
                ctx.cmd_next[str(node)] = index + 1
                keys.append(P.host_command_key(node, index))
                values.append(P.write_message(P.HostCommands(part)))
                if len(keys) == SET_BATCH:
                    send_keys()
        send_keys()
        ctx.outbox = []

    def adopt(self, parts: set[tuple[str, str]]) -> None:
        """A resumed controller's: ``parts`` (whose, digest), named by the snapshot it read,
        are its predecessor's, which no save of this one names (it writes its own). They
        are deleted a while after the takeover: ``ADOPTED_GRACE_CHECKS`` of the
        predecessor's checks for a newer controller, after which it has stepped down (a
        predecessor still saving for a moment writes snapshots that name them)."""
        self._adopted = sorted(parts)
        self._adopted_until = time.monotonic() + \
            ADOPTED_GRACE_CHECKS * self.ctx.cfg.controller.incarnation_check_s

    def _save_file(self, payload: bytes, parts: dict[str, str]) -> None:
        """The run dir's copy of the snapshot (``snapshot_codec``): junk written over the
        store's copy cannot stop a restarted controller. Saved with the store's, so never
        older than what was sent; if it cannot be written (a full disk), it is removed
        rather than left behind stale, and the job goes on with the store's copy alone."""
        if self.run_key is None:
            return                   # failed before the run began: nothing to resume
        try:
            self.file_parts.put_parts(parts)
            snapshot_codec.write_file(self.run_dir, self.run_key, payload)
            self._file_failed = False
        except OSError as exc:
            self.file_parts.lost()
            try:
                os.unlink(snapshot_codec.file_path(self.run_dir))
            except OSError:
                pass
            if not self._file_failed:
                self._file_failed = True
                self.ctx.events.emit("snapshot_file_not_written", level="warning",
                                     error=str(exc))

    def _write_status(self, state: dict) -> None:
        """``status.json`` for ``trainmover status`` (``control/status.py``)."""
        store = self.ctx.store
        keys = store.raw.num_keys() if hasattr(store, "raw") else None
        perf = self.perf()
        try:
            status = status_columns(state, perf, os.getpid(), keys, source="controller",
                                    recorded=True)
            status["interval_s"] = self._status_every
            write_status_file(self.run_dir, status)
        except OSError as exc:   # a full disk must not stop the job: status falls back
            self.ctx.events.emit("status_not_written", level="warning", error=str(exc))
