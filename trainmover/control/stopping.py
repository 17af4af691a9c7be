"""The controller's driver for a graceful stop (``trainmover stop``, SIGTERM/SIGINT/SIGHUP of
``trainmover run``/``launch``, ``Job.stop``): every worker finishes the step it is in and a
few more, writes the checkpoint taken before the agreed stop step, and exits; the job then
ends with ``stopped`` in its summary, and ``trainmover run --resume`` continues it from that
checkpoint, bit-identical to a run that never stopped.

The order waits for a migration in flight to end and for a recovery to complete (no new
migration starts meanwhile). A recovery that begins after the order went out voids it (the
survivors drop commands while recovering; the joiners never had it): it is sent again, under
a new stop id, once the recovery is done.
"""
from __future__ import annotations

import time

from trainmover.control.context import JobContext
from trainmover.core import protocol as P


class Stopping:
    STATE = ("reason", "stop_id", "sent_epoch", "t_requested")

    def __init__(self, ctx: JobContext):
        self.ctx = ctx
        self.reason: str | None = None
        self.stop_id = 0
        self.sent_epoch: int | None = None   # the epoch the current order went out in
        self.t_requested: float | None = None
        self._asked: str | None = None       # set from other threads (signal handler, API)
        self._rejected: bytes | None = None  # the last refused request (logged once)

    @property
    def requested(self) -> bool:
        return self.reason is not None

    @property
    def asked(self) -> bool:
        """A stop was asked for (perhaps not yet taken up by the controller's loop)."""
        return self._asked is not None or self.reason is not None

    def request(self, reason: str) -> None:
        """Thread-safe (one attribute assignment): ask for a graceful stop."""
        if self._asked is None:
            self._asked = reason

    def collect(self, from_store: bool) -> None:
        """Take a request made through the API or, with ``from_store``, ``trainmover stop``."""
        ctx = self.ctx
        if self.reason is not None:
            return
        reason = self._asked
        if reason is None and from_store and ctx.store.check([P.STOP_REQUEST_KEY]):
            # a refused value is not read twice, but a new one is: junk written there must
            # not disable `trainmover stop` for the rest of the job
            raw = ctx.store.raw.get(P.STOP_REQUEST_KEY)
            if raw != self._rejected:
                ask = ctx.read(P.StopAsk, P.STOP_REQUEST_KEY)
                self._rejected = raw if ask is None else None
                reason = ask.reason[:200] if ask is not None else None
        if reason is None:
            return
        self.reason, self.t_requested = reason, time.time()
        ctx.events.emit("stop_requested", reason=reason, at_step=ctx.progress.last_step + 1)
        ctx.progress.say(f"stopping ({reason}): every worker checkpoints a few steps ahead, "
                         f"then exits; `trainmover run --resume {ctx.run_dir}` continues")

    def poll(self, busy: bool) -> None:
        """Send the order once nothing is in flight (``busy``: a migration or recovery)."""
        ctx = self.ctx
        if self.reason is None:
            return
        if self.sent_epoch is not None and self.sent_epoch != ctx.epoch:
            self.sent_epoch = None   # a recovery moved the job on: order again after it
        if self.sent_epoch is not None or busy:
            return
        self.stop_id += 1
        self.sent_epoch = ctx.epoch
        for worker in sorted(ctx.membership.workers):
            ctx.send(worker, P.Stop(self.stop_id))
        ctx.events.emit("stop_ordered", stop_id=self.stop_id, epoch=ctx.epoch)

    def stop_step(self) -> int | None:
        """The step the workers agreed to stop at (None before any of them saw the order)."""
        key = P.stop_step_key(self.stop_id)
        value = self.ctx.store.valid(key) if self.stop_id else None
        return int(value) if value is not None else None
