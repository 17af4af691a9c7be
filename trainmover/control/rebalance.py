"""Rolling maintenance (``--rebalance-every SECONDS``): every so often the controller moves
the next worker, in a fixed rotation over the roles, onto a warm standby; the process it
replaces leaves the job (its machine is free for maintenance). Also the ETTR experiment:
how much training time a job keeps while its workers are moved one after another."""
from __future__ import annotations

import time

from trainmover.control.context import JobContext
from trainmover.control.migrations import MigrationRequest, Migrations
from trainmover.core import decisions as C


class Rebalancer:
    STATE = ("next_role", "moved")

    def __init__(self, ctx: JobContext, migrations: Migrations):
        self.ctx, self.migrations = ctx, migrations
        self.next_role = 0          # index into the layout's roles
        self.moved: list[str] = []
        self._due = time.monotonic() + ctx.cfg.maintenance.rebalance_every_s

    def poll(self) -> None:
        ctx = self.ctx
        every = ctx.cfg.maintenance.rebalance_every_s
        if not every or time.monotonic() < self._due:
            return
        if self.migrations.active is not None or self.migrations.pending:
            return      # the next one waits for this one; the clock starts after it
        if not any(st is C.StandbyState.WARM for st in ctx.membership.standbys.values()):
            return
        roles = ctx.membership.layout.roles()
        role = roles[self.next_role % len(roles)]
        self.next_role += 1
        holder = next(w for w, r in ctx.membership.workers.items() if r == role)
        self.moved.append(holder)
        self._due = time.monotonic() + every
        ctx.events.emit("rebalance", worker=holder, role=role.name)
        self.migrations.submit(MigrationRequest([holder], source="rebalance"))
