"""The controller's driver for replica agreement: data-parallel replicas must hold the same
state after every step (the same gradients, averaged, applied by the same optimizer), and a
replica is the recovery source of a failed role, so a silently diverged one (a bad GPU, a
kernel that is not deterministic, a bug in a script's data parallelism) must be found, not
copied. Each role posts its state's digest at the job's end and, with
``health.verify_every``, every that many steps; the controller compares those of each
(pipeline stage, tensor shard) across data-parallel ranks. A mismatch is an error event that
names the replicas and ``replicas_agree: false`` in the summary; training goes on."""
from __future__ import annotations

from trainmover.control.context import JobContext
from trainmover.core import protocol as P


class Replicas:
    STATE = ("next_check", "checked", "disagreements")

    def __init__(self, ctx: JobContext):
        self.ctx = ctx
        every = ctx.cfg.health.verify_every
        self.next_check: int | None = every if every else None
        self.checked: list[int] = []
        self.disagreements: list[dict] = []

    def poll(self) -> None:
        """Compare the periodic digests once every role posted them."""
        ctx = self.ctx
        if self.next_check is None or not ctx.cfg.layout.has_replicas:
            return
        if ctx.progress.last_step + 1 < self.next_check or \
                self.next_check >= ctx.cfg.train.steps > 0:
            return
        if self.compare(self.next_check):
            self.next_check += ctx.cfg.health.verify_every

    def compare(self, step: int) -> bool:
        """Compare the digests of ``step`` if every role posted one (True), else False."""
        ctx = self.ctx
        layout = ctx.membership.layout
        keys = {r: P.replica_digest_key(step, r.name) for r in layout.roles()}
        if not ctx.store.check(list(keys.values())):
            return False
        values = {r: ctx.store.valid(k) for r, k in keys.items()}
        if any(v is None for v in values.values()):
            return False               # a forged digest: not posted (yet) as far as we know
        digests = {r: v.decode() for r, v in values.items()}
        holders = {r.name: w for w, r in ctx.membership.workers.items()}
        for pp in range(layout.pp):
            for tp in range(layout.tp):
                group = {r: d for r, d in digests.items() if r.pp == pp and r.tp == tp}
                if len(set(group.values())) > 1:
                    found = {"step": step, "stage": pp, "shard": tp,
                             "replicas": {r.name: {"worker": holders.get(r.name),
                                                   "digest": d} for r, d in group.items()}}
                    self.disagreements.append(found)
                    ctx.events.emit("replicas_disagree", level="error", **found)
                    ctx.progress.say(
                        f"error: data-parallel replicas of stage {pp} shard {tp} hold "
                        f"different states before step {step}: " + ", ".join(
                            f"{r.name} ({holders.get(r.name)}) {d[:12]}"
                            for r, d in sorted(group.items(), key=lambda x: x[0].dp)))
        for key in keys.values():
            ctx.store.delete_key(key)
        self.checked.append(step)
        ctx.events.emit("replicas_checked", step=step,
                        agree=not any(d["step"] == step for d in self.disagreements))
        return True

    def agree(self) -> bool | None:
        """None when nothing was compared (no data-parallel replicas)."""
        if not self.checked:
            return None
        return not self.disagreements
