"""A planned migration in ``bench control``'s simulated job (``bench/control_sim.py``): the
stayers and the leaver run the job's own ``worker.migration.Migrations`` (its commands,
phase 1 in the background, the ready report, the agreed switch step, the switch report and
the step-end times the controller's downtime accounting reads), over stand-ins for what a
simulation has none of:

- a group build is the rendezvous store traffic of the job's backend (the worker's
  ``_rendezvous``) and gives a group that does nothing (``SimGroup``);
- the leaver has no state to lay out or send: at the switch it claims the handover, marks
  the step it left at and reports, as a leaver does, and leaves;
- the joiner's state arrives with no transfer: it waits in the store for the step its
  leaver left at (the key the leaver writes just before it sends its state; a job's joiner
  learns that step from the state's header on their channel).

Imported by ``control_sim`` after gevent's monkey-patching.
"""
from __future__ import annotations

import time
from datetime import timedelta

from trainmover.core import protocol as P
from trainmover.core.topology import Role
from trainmover.worker import migration as M


class SimGroup:
    """A built communicator that carries nothing."""

    def shutdown(self) -> None:
        pass


class SimBuilder:
    """``comm.groups.GroupBuilder`` for a simulated worker: a build is its rendezvous, on a
    store client of its own for the build (as a worker's prepare thread has one: a light
    worker's one client serves its agent's loop meanwhile)."""

    def __init__(self, worker):
        self.worker = worker

    def build(self, spec, role: Role, generation: int) -> SimGroup:
        return self.build_ranked(spec, spec.members.index(role), generation)

    def build_ranked(self, spec, rank: int, generation: int,
                     abortable: bool = True) -> SimGroup:
        stores = self.worker.own_stores()
        try:
            self.worker._rendezvous(spec.name, generation, rank, spec.size,
                                    stores.get().raw)
        finally:
            stores.close()
        return SimGroup()


class SimGroups:
    """``comm.groups.CommGroups`` of a simulated worker: installing swaps nothing."""

    def install(self, built: dict) -> list:
        return list(built.values())

    def shutdown(self) -> None:
        pass


class NoEvents:
    """The workers' events are not written (thousands of them; the controller's are)."""

    def emit(self, event: str, **fields) -> None:
        pass


class SimMigrations(M.Migrations):
    """A simulated worker's migrations: the job's own, but for the leaver's state (none)."""

    def __init__(self, worker):
        super().__init__(worker.name, worker.role, worker.layout, SimGroups(),
                         SimBuilder(worker), worker.stores, worker.commands, NoEvents())

    def _advance(self, part: M.Participation, step: int) -> str | None:
        if part.kind == "leaver" and part.layout_sent is None:
            part.layout_sent = []        # no state: no layout to post the joiner
        return super()._advance(part, step)

    def _switch(self, part: M.Participation, step: int) -> str | None:
        if part.kind != "leaver":
            return super()._switch(part, step)
        # the leaver's store traffic at the switch (``Migrations._switch``), its transfer
        # none
        mid, t0 = part.migration_id, time.perf_counter()
        outcome = self.store.compare_set(P.mig_key(mid, "outcome", self.name), "",
                                         "handover").decode()
        if outcome != "handover":
            self._drop(part, "a failure interrupted the migration before the handover")
            return None
        self.store.set(P.mig_key(mid, "at_switch", self.name), str(step))
        report = P.SwitchReport(wait_boundary_s=t0 - (part.t_go or t0), build_s=part.build_s,
                                switch_s=time.perf_counter() - t0)
        self.store.set(P.mig_key(mid, "switched", self.name), P.write_message(report))
        self.store.add(P.mig_key(mid, "switched_count"), 1)
        del self.active[mid]
        return M.LEAVE


def take_over(worker, cmd: P.AssignMigration) -> tuple[int, float]:
    """A standby's phase 1 and switch as the migration's joiner (``worker/loop.py``'s): the
    role's groups and the channel built, ready reported, then the step its leaver left at
    (the first this worker trains). Returns that step and when the wait for it ended."""
    t0 = time.perf_counter()
    role = Role.parse(cmd.role)
    worker.role = role
    layout = worker.layout
    builder = SimBuilder(worker)
    for spec in sorted(layout.groups_of(role).values(), key=lambda s: s.name):
        if spec.size > 1:
            builder.build(spec, role, cmd.groups.get(spec.name, 0))
    builder.build_ranked(M.transfer_spec(cmd.transfer_group, role), 1,
                         cmd.transfer_generation, abortable=False)
    build_s = time.perf_counter() - t0
    store = worker.stores.get()
    M.joiner_ready(store, NoEvents(), worker.name, cmd.migration_id, build_s, build_s)
    key = P.mig_key(cmd.migration_id, "at_switch", cmd.leaver)
    while True:
        store.raw.wait([key], timedelta(seconds=worker.cfg.comm.group_timeout_s))
        at = store.valid(key)
        if at is not None:
            return int(at), time.perf_counter()
        time.sleep(0.01)             # unsigned (forged): not the leaver's; wait on


def joiner_started(worker, cmd: P.AssignMigration, step: int, t_start: float,
                   first_step_s: float) -> None:
    """After the joiner's first step: its switch report (``migration.joiner_started``)."""
    M.joiner_started(worker.stores.get(), NoEvents(), worker.name, cmd.migration_id,
                     {"recv_s": time.perf_counter() - t_start, "transfer_s": 0.0,
                      "transfer_bytes": 0}, step, first_step_s)
