"""The restart baseline, run by the same controller so it is measured on the same job: what
torchrun/Megatron users do today. Every process is stopped; fresh ones rebuild every group
(under a new generation) and reload the newest complete checkpoint. Used by ``bench`` for
planned events (``baseline.restart_at_step``) and failures (``baseline.restart_on_failure``).
"""
from __future__ import annotations

import os
import statistics
import time

from trainmover.control.context import JobContext
from trainmover.control.errors import JobFailed
from trainmover.core.accounting import downtime_from_metrics
from trainmover.core.events import read_jsonl
from trainmover.core.files import latest_complete


class Restarts:
    STATE = ("restarts",)

    def __init__(self, ctx: JobContext):
        self.ctx = ctx
        self.restarts: list[dict] = []

    def due(self) -> bool:
        """The planned restart's step was reached (and it has not run yet)."""
        k = self.ctx.cfg.baseline.restart_at_step
        self.ctx.progress.poll()
        planned_done = any(r["cause"] == "planned" for r in self.restarts)
        return k is not None and not planned_done and self.ctx.progress.last_step == k - 1

    def restart(self, step: int | None = None, cause: str = "planned") -> None:
        """Start fresh processes for every role from the step-``step`` checkpoint. They vote
        in a new epoch, so no decision of the steps they redo is taken as made."""
        ctx = self.ctx
        k = ctx.cfg.baseline.restart_at_step if step is None else step
        t = time.time()
        m = ctx.membership
        generation = max(m.next_generation.values(), default=1)
        for name in m.next_generation:
            m.generations[name] = generation
            m.next_generation[name] = generation + 1
        ctx.epoch += 1
        ctx.committed = k - 1
        ctx.disrupted()
        ctx.events.emit("restart_began", step=k, generation=generation, cause=cause)
        self.restarts.append({"step": k, "t_all_stopped": t, "generation": generation,
                              "cause": cause})
        ctx.progress.say(f"restart ({cause}): all workers stopped; starting fresh processes "
                         f"from the step-{k} checkpoint")
        for name in m.workers:
            ctx.spawn(name, standby=False, resume_step=k, generation=generation,
                      epoch=ctx.epoch)

    def after_failure(self, failures: list) -> None:
        """The baseline's answer to a failure: fence every worker, restart from the newest
        complete checkpoint (what an elastic launcher does)."""
        ctx = self.ctx
        reason = ", ".join(f"{f.worker} {f.kind}" for f in failures)
        ctx.events.emit("failure_detected", recovery_id=None, epoch=ctx.epoch,
                        failures=[f.__dict__ for f in failures], action="restart")
        for w in ctx.membership.workers:
            ctx.fence(w, f"restart after {reason}")
        step = latest_complete(ctx.run_dir, [r.name for r in ctx.membership.layout.roles()])
        if step is None:
            raise JobFailed(f"{reason}: no complete checkpoint to restart from")
        self.restart(step, cause=failures[0].kind)

    def report(self) -> list[dict]:
        ctx = self.ctx
        out = []
        records = ctx.progress.records
        events = read_jsonl(os.path.join(ctx.run_dir, "events.jsonl"))
        for r in self.restarts:
            k = r["step"]
            if ctx.progress.last_step < k:
                continue
            downtime, normal = downtime_from_metrics(records, k)
            later = [e for e in events if e["time"] >= r["t_all_stopped"]]

            def longest(event, key="duration_s"):
                return max([e.get(key, 0.0) for e in later if e["event"] == event] or [0.0])

            prev = next(x["time"] for x in records if x["step"] == k - 1)
            first = next(x for x in records if x["step"] == k and x["time"] > r["t_all_stopped"])
            if r["cause"] != "planned":
                # from the fault to the first step committed after the restart
                faults = [e["time"] for e in ctx.fault_events() if e["time"] <= r["t_all_stopped"]]
                t_fault = max(faults) if faults else r["t_all_stopped"]
                downtime = first["time"] - t_fault
                prev = t_fault
            out.append({"step": k, "cause": r["cause"], "downtime_s": downtime, "phases": {
                "stop_s": r["t_all_stopped"] - prev,
                "process_start_import_s": longest("worker_started", "import_s"),
                "groups_s": longest("groups_built"),
                "checkpoint_load_s": longest("checkpoint_loaded"),
                "first_step_s": first["step_time_s"],
                "normal_step_s": normal,
                # first_step_s's own quantity (a step's time in the loop) before the stop
                "normal_train_step_s": _median_step_time(records, k)}})
        return out


def _median_step_time(records: list[dict], before: int, steps: int = 5) -> float | None:
    times = [r["step_time_s"] for r in records if before - steps <= r["step"] < before]
    return statistics.median(times) if times else None
