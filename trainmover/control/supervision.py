"""The controller's driver for processes: exits that end the job (a script that misuses the
runtime, a standby that refused to serve, a worker exit nothing recovers from), each free
standby's readiness (cold, warming, warm), as the standbys report it, and the standby pool:
a hung standby is fenced (a joiner's migration or recovery then gives it up, as when a
joiner dies), and with ``standby.replenish`` the pool is kept at ``standby.count``."""
from __future__ import annotations

import time

from trainmover.control.context import JobContext
from trainmover.control.errors import JobFailed
from trainmover.core import decisions as C
from trainmover.core import protocol as P


class ProcessWatch:
    STATE = ("warm_for", "replenished")

    def __init__(self, ctx: JobContext):
        self.ctx = ctx
        self.warm_for: dict[str, list[str]] = {}    # standby -> stage structures it rehearsed
        self.replenished = 0                        # standbys started to refill the pool
        self._standbys_read_at = 0.0

    def check_exits(self, recovered: set[str]) -> None:
        """Raise ``JobFailed`` for an exit that ends the job; ``recovered`` are workers whose
        failure a recovery already handled."""
        ctx = self.ctx
        # the failed processes only, from the process table's index (a loop over every
        # process each round was O(N) a round); workers before standbys, as they were
        # started (the error that ends a job names a worker's, when a worker failed)
        for name in sorted(ctx.procs.failed(),
                           key=lambda n: (ctx.procs.procs[n].standby, C.natural(n))):
            p = ctx.procs.procs[name]
            code = p.code
            report = self._standby_report(name) if p.standby else None
            if report is not None and report.state == "refused":
                raise JobFailed(f"standby {name} refused to serve: {report.reason}")
            if code == P.EXIT_USAGE:
                raise JobFailed(f"{name}: stopped on an error no restart fixes (the training "
                                f"script misuses the runtime, or the job's script, "
                                f"configuration or data changed; exit code {code}); last log "
                                f"lines:\n{ctx.procs.tail(name)}")
            if p.standby and name not in ctx.membership.workers:
                if ctx.membership.standbys.get(name) not in (C.StandbyState.DEAD, None):
                    ctx.membership.standbys[name] = C.StandbyState.DEAD
                    ctx.events.emit("standby_died", name=name, code=code)
                    ctx.progress.say(f"standby {name} exited with code {code}")
                continue
            if ctx.cfg.health.recover and name in ctx.membership.workers:
                continue  # the recovery driver detects, fences and replaces it
            if name in ctx.membership.departed or name in recovered:
                continue
            raise JobFailed(f"worker {name} exited with code {code}; last log lines:\n"
                            f"{ctx.procs.tail(name)}")

    def fence_hung_standbys(self, hung: list[tuple[str, str]]) -> None:
        """Kill standbys that stopped beating: a free one leaves the pool; a reserved one
        (a joiner) then exits, which aborts its migration or abandons its recovery plan."""
        ctx = self.ctx
        for name, why in hung:
            ctx.fence(name, f"standby hung: {why}")
            state = ctx.membership.standbys.get(name)
            ctx.events.emit("standby_hung", name=name, reason=why,
                            state=None if state is None else state.value, level="warning")
            ctx.progress.say(f"standby {name} hung ({why}): fenced")
            if state is not C.StandbyState.RESERVED:
                ctx.membership.standbys[name] = C.StandbyState.DEAD

    def replenish(self) -> None:
        """Start standbys until the pool has ``standby.count`` live ones (see module doc)."""
        ctx, cfg = self.ctx, self.ctx.cfg.standby
        if not cfg.replenish:
            return
        live = [s for s, st in ctx.membership.standbys.items()
                if st is not C.StandbyState.DEAD and s not in ctx.membership.workers]
        while len(live) < cfg.count and self.replenished < cfg.replenish_max:
            name = ctx.new_standby(C.StandbyState.STARTING)
            ctx.spawn(name, standby=True)
            self.replenished += 1
            live.append(name)
            ctx.events.emit("standby_replenished", name=name, pool=len(live),
                            replenished=self.replenished)
            ctx.progress.say(f"standby pool below {cfg.count}: started {name}")

    def update_standbys(self) -> None:
        """Follow each free standby's readiness as it reports it."""
        ctx = self.ctx
        now = time.monotonic()
        if now - self._standbys_read_at < ctx.cfg.controller.standby_poll_s:
            return
        self._standbys_read_at = now
        for name, st in ctx.membership.standbys.items():
            if st in (C.StandbyState.DEAD, C.StandbyState.RESERVED) or \
                    not ctx.procs.known(name):
                continue
            report = self._standby_report(name)
            if report is None:
                continue
            if report.state == "refused":
                raise JobFailed(f"standby {name} refused to serve: {report.reason}")
            new = C.StandbyState(report.state)
            if new is not st or report.warm_for != self.warm_for.get(name):
                ctx.membership.standbys[name] = new
                self.warm_for[name] = report.warm_for
                ctx.events.emit("standby_state", name=name, state=new.value,
                                warm_for=report.warm_for)
                ctx.progress.say(f"standby {name}: {new.value}" +
                                 (f" for {', '.join(report.warm_for)}" if report.warm_for else ""))

    def _standby_report(self, name: str) -> P.StandbyReport | None:
        return self.ctx.read(P.StandbyReport, P.standby_state_key(name))
