"""What a worker does between training steps: take commands, prepare and carry out migrations.

Phase 1 (``prepare``): a background thread, with its own store client, builds the next
generation of this worker's affected groups while the main thread keeps training on the
current ones. Phase 2 (the switch): at the agreed boundary the main thread installs the new
groups (and the leaver hands its state to the joiner). Nothing here runs inside a step.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

from . import protocol as P
from .comm import CommGroups, Group, GroupBuilder, StoreClients
from .events import EventLog
from .topology import GroupSpec, Layout, Role
from .transfer import send_state


def rss_mb() -> dict:
    """Current and peak resident set size of this process, in MiB (Linux)."""
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    key, value = line.split(":", 1)
                    out["rss_mb" if key == "VmRSS" else "peak_rss_mb"] = int(value.split()[0]) / 1024
    except OSError:
        pass
    return out


class CommandChannel:
    """Waits for this worker's commands in a daemon thread; the training loop polls a queue."""

    def __init__(self, stores: StoreClients, worker: str):
        self.worker = worker
        self.queue: queue.Queue = queue.Queue()
        self._stores = stores
        threading.Thread(target=self._loop, name=f"commands-{worker}", daemon=True).start()

    def _loop(self) -> None:
        store = self._stores.get()  # this thread's own client
        index = 1
        while True:
            key = P.command_key(self.worker, index)
            try:
                store.wait([key], timedelta(hours=24))
            except Exception:  # noqa: BLE001 - store gone (job over) or a long idle wait
                if not self._store_alive(store):
                    return
                continue
            self.queue.put(P.decode(store.get(key)))
            index += 1

    @staticmethod
    def _store_alive(store) -> bool:
        try:
            store.check(["_"])
            return True
        except Exception:  # noqa: BLE001
            return False

    def poll(self) -> list[dict]:
        out = []
        while True:
            try:
                out.append(self.queue.get_nowait())
            except queue.Empty:
                return out

    def next(self) -> dict:
        """Block until a command arrives; raise if the job's store has gone away."""
        while True:
            try:
                return self.queue.get(timeout=1.0)
            except queue.Empty:
                if not self._store_alive(self._stores.get()):
                    raise RuntimeError(f"{self.worker}: the job's store is gone; exiting")


def transfer_spec(name: str, role: Role) -> GroupSpec:
    """The leaver/joiner channel: both hold the same role; the leaver is rank 0."""
    return GroupSpec(name, "xfer", (role, role))


@dataclass
class Participation:
    """One migration as seen by one worker."""

    migration_id: int
    kind: str                          # "stayer" | "leaver"
    command: dict
    built: dict[str, Group] = field(default_factory=dict)
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    reported_ready: bool = False
    dropped: bool = False
    switch_at: int | None = None
    t_go: float | None = None
    build_s: float = 0.0
    rss_before: dict = field(default_factory=dict)


LEAVE = "leave"


class WorkerRuntime:
    """Owns a worker's membership in migrations; ``at_boundary`` is called before each step."""

    def __init__(self, name: str, role: Role, layout: Layout, groups: CommGroups,
                 builder: GroupBuilder, stores: StoreClients, commands: CommandChannel,
                 events: EventLog):
        self.name, self.role, self.layout, self.groups = name, role, layout, groups
        self.builder, self.stores, self.commands, self.events = builder, stores, commands, events
        self.store = stores.get()
        self.active: dict[int, Participation] = {}
        self.retired: list[Group] = []
        self.engine = None  # set by the worker once built
        self.on_point = lambda point, step: None   # fault injection (faults.hit)

    # --- the per-step hook ---------------------------------------------------------------
    def at_boundary(self, step: int) -> str | None:
        if self.retired:
            # closing a gloo group joins its threads (tens of ms): do it beside training
            retired, self.retired = self.retired, []
            threading.Thread(target=lambda: [g.shutdown() for g in retired], daemon=True,
                             name="retire-groups").start()
        for cmd in self.commands.poll():
            self._accept(cmd, step)
        if not self.active:
            return None  # the common case: one queue look-up, nothing else
        for mid in list(self.active):
            part = self.active[mid]
            outcome = self._advance(part, step)
            if outcome == LEAVE:
                return LEAVE
        return None

    # --- commands ------------------------------------------------------------------------
    def _accept(self, cmd: dict, step: int) -> None:
        kind = cmd["type"]
        if kind not in ("prepare", "leave"):
            raise ValueError(f"worker {self.name}: unknown command {kind!r}")
        mid = cmd["migration_id"]
        part = Participation(mid, "stayer" if kind == "prepare" else "leaver", cmd,
                             rss_before=rss_mb())
        self.active[mid] = part
        self.events.emit("migration_prepare", migration_id=mid, part=part.kind,
                         groups=cmd.get("groups", {}), naive=cmd.get("naive", False))
        self.on_point("prepare", step)
        if cmd.get("naive"):
            part.done.set()  # the naive baseline prepares nothing ahead: all of it at the switch
            return
        threading.Thread(target=self._build, args=(part,), daemon=True,
                         name=f"prepare-{mid}").start()

    def _specs(self, part: Participation) -> list[tuple[GroupSpec, int, Role]]:
        """(spec, generation, my role in it) of every group this worker builds."""
        cmd = part.command
        if part.kind == "leaver":
            return [(transfer_spec(cmd["transfer_group"], self.role), cmd["transfer_generation"],
                     self.role)]
        all_specs = self.layout.all_groups()
        return [(all_specs[n], g, self.role) for n, g in sorted(cmd["groups"].items())]

    def _build(self, part: Participation) -> None:
        """Phase 1 in a background thread; the builder gives this thread its own store client."""
        t0 = time.perf_counter()
        try:
            for spec, gen, role in self._specs(part):
                group = self._build_one(spec, role, gen, part)
                if part.dropped:  # abandoned while we waited: close what we made
                    group.shutdown()
                    continue
                part.built[spec.name] = group
        except BaseException as exc:  # noqa: BLE001 - reported at the next boundary
            part.error = exc
        part.build_s = time.perf_counter() - t0
        part.done.set()

    def _build_one(self, spec: GroupSpec, role: Role, gen: int, part: Participation) -> Group:
        if spec.kind == "xfer":
            return self.builder.build_ranked(spec, 0 if part.kind == "leaver" else 1, gen)
        return self.builder.build(spec, role, gen)

    # --- progress of one migration ---------------------------------------------------------
    def _advance(self, part: Participation, step: int) -> str | None:
        mid = part.migration_id
        store = self.store
        if store.check([P.mig_key(mid, "abort")]):
            self._drop(part, store.get(P.mig_key(mid, "abort")).decode())
            return None
        if not part.done.is_set():
            return None
        if part.error is not None:
            err = part.error
            self._drop(part, f"phase 1 failed: {err}")
            raise RuntimeError(f"migration {mid}: preparing groups failed on {self.name}: {err}")
        if not part.reported_ready:
            part.reported_ready = True
            store.set(P.mig_key(mid, "ready", self.name),
                      P.encode({"build_s": part.build_s, "step": step}))
            store.add(P.mig_key(mid, "ready_count"), 1)
        if part.switch_at is None:
            if not store.check([P.mig_key(mid, "go")]):
                return None
            part.t_go = part.t_go or time.perf_counter()
            proposal = str(step + P.SWITCH_MARGIN_STEPS)
            part.switch_at = int(store.compare_set(P.mig_key(mid, "switch_at"), "", proposal))
        if step < part.switch_at:
            return None
        if step > part.switch_at:
            raise RuntimeError(f"migration {mid}: {self.name} is at step {step}, past the switch "
                               f"step {part.switch_at}")
        return self._switch(part, step)

    def _switch(self, part: Participation, step: int) -> str | None:
        """Phase 2, at the agreed boundary: every collective of the previous step has
        completed (train_step waits for all its work), so the old groups are quiet."""
        mid, cmd = part.migration_id, part.command
        self.on_point("switch", step)
        t0 = time.perf_counter()
        report = {"wait_boundary_s": t0 - (part.t_go or t0), "build_s": part.build_s,
                  "rss_before": part.rss_before}
        if part.kind == "leaver":
            # the point of no return, decided once: the controller claims "abort" the same
            # way when a failure interrupts the migration, and only one of us can win
            outcome = self.store.compare_set(P.mig_key(mid, "outcome", self.name), "",
                                             "handover").decode()
            if outcome != "handover":
                self._drop(part, "a failure interrupted the migration before the handover")
                return None   # still this role's holder: recovery treats us as a survivor
            self.store.set(P.mig_key(mid, "at_switch", self.name), str(step))
            if cmd.get("naive"):
                spec, gen, role = self._specs(part)[0]
                part.built[spec.name] = self._build_one(spec, role, gen, part)
            channel = part.built[cmd["transfer_group"]]
            sent = send_state(self.engine, channel, 1, step)
            report.update(transfer_s=sent["seconds"], transfer_bytes=sent["bytes"])
            channel.shutdown()
            self.groups.shutdown()
        else:
            if cmd.get("naive"):
                tb = time.perf_counter()
                for spec, gen, role in self._specs(part):
                    part.built[spec.name] = self._build_one(spec, role, gen, part)
                report["build_s"] = time.perf_counter() - tb
            ti = time.perf_counter()
            # the replaced groups are closed at the next boundary, off the critical path;
            # nothing can use them any more: every holder reads the new slots
            self.retired.extend(self.groups.install(part.built))
            report["install_s"] = time.perf_counter() - ti
        report["switch_s"] = time.perf_counter() - t0
        report["rss_after"] = rss_mb()
        self.store.set(P.mig_key(mid, "switched", self.name), P.encode(report))
        self.store.add(P.mig_key(mid, "switched_count"), 1)
        self.events.emit("migration_switched", migration_id=mid, step=step, part=part.kind,
                         **{k: v for k, v in report.items() if k.endswith("_s")})
        del self.active[mid]
        return LEAVE if part.kind == "leaver" else None

    def _drop(self, part: Participation, reason: str) -> None:
        """Abandon a migration: the live groups were never touched; prepared ones are closed
        (a builder still waiting for a dead joiner closes its group when it gives up)."""
        part.dropped = True
        for g in list(part.built.values()):
            g.shutdown()
        self.events.emit("migration_dropped", migration_id=part.migration_id, reason=reason)
        del self.active[part.migration_id]
