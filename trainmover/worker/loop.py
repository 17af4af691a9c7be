"""A real run's step loop (an active worker's or a joiner's; a standby's shadow run is the
runtime's own, ``Runtime._shadow_steps``): where the run starts, then per step the migration
boundary, the commit vote, recovery on a failed step, checkpoints, snapshots, metrics and the
recording for the standbys; then the final state.
"""
from __future__ import annotations

import os
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

from trainmover.comm import pipelining
from trainmover.comm.record import representative_roles, structure_depths
from trainmover.core import protocol as P
from trainmover.core.events import JsonlWriter
from trainmover.core.faults import slowdowns
from trainmover.core.files import DIGEST_FILE, final_dir
from trainmover.core.topology import Role
from trainmover.train import rng
from trainmover.train.checkpoint import AsyncCheckpointer, load_local
from trainmover.train.final import write_final_shard
from trainmover.train.snapshot import PeerSnapshotter
from trainmover.train.state import state_digest
from trainmover.worker import migration as M
from trainmover.worker import recover as R
from trainmover.worker.context import Start
from trainmover.worker.errors import DataNotDeterministic, UsageError
from trainmover.worker.liveness import CommitVote, HostVote
from trainmover.worker.perf import StepMeter
from trainmover.worker.recording import StepRecorder

if TYPE_CHECKING:
    import torch

    from trainmover.worker.runtime import Runtime

# The step a job without a standby's data check runs twice (``DataConfig.rehearse``): the
# first step a joiner can start at, and the first after torch's first-step set-up.
REHEARSAL_STEP = 1

# How often a replica, done with its steps, looks whether the final state is assembled or it
# must write its share (a wait of about the final assembly, once per job).
FINAL_WAIT_POLL_S = 0.05


class Departed(BaseException):
    """Ends a leaver's script run: its role now belongs to the joiner (not an error).
    A BaseException, so a script's ``except Exception`` does not swallow it."""


@dataclass
class StepInFlight:
    """The step the script is running: what the runtime's loop and the script's calls
    (``commit``, ``fingerprint``) share."""

    index: int
    t_start: float
    commit: bool | None = None          # the commit point's answer; None until it is called
    metrics: dict = field(default_factory=dict)
    # whether this step's data is checked (only the steps a standby compares: hashing every
    # batch would put a host copy and a hash on every step's path), and its digest
    fingerprinted: bool = False
    batch_digest: str | None = None     # the step's data, as the script first fed it
    # the first attempt of the rehearsed step (``DataConfig.rehearse``): never committed
    rehearsal: bool = False


def _forget_attempt(scaler) -> None:
    """What ``GradScaler.update()`` does to prepare the next iteration, without the update
    of the scale (torch 2.13: its per-optimizer states start afresh)."""
    from torch.amp.grad_scaler import _refresh_per_optimizer_state

    if not hasattr(scaler, "_per_optimizer_states"):
        raise UsageError("this torch's GradScaler has no _per_optimizer_states (torch 2.13 "
                         "has): trainmover cannot redo a step with it")
    scaler._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)


def guard_optimizer(rt: Runtime, optimizer: torch.optim.Optimizer) -> None:
    """Make the registered optimizer's ``step()`` the commit point of a script that does
    not call ``rt.commit()``: a pre-hook (torch's, so it runs however ``step`` is reached:
    directly, through a GradScaler, an LR scheduler's wrapper) votes if the step has not
    voted yet, and in a step that is not committed empties every gradient first, which makes
    the step a no-op (torch's optimizers skip a parameter without a gradient, moments and
    step counts included). A script that commits explicitly is unaffected; one that calls
    ``step()`` after ``rt.commit()`` returned False is kept from applying the step."""

    def before_step(opt, args, kwargs):
        cur = rt.current
        if cur is None:
            return None            # outside rt.steps(): not a training step of the job
        if cur.commit is None:
            rt.commit()
        if not cur.commit:
            for group in opt.param_groups:
                for p in group["params"]:
                    p.grad = None
        elif rt.loop is not None:
            # a pre-copying leaver sends the gradients this step applies (train/precopy.py)
            rt.loop.migrations.before_optimizer(cur.index, args, kwargs)
        return None

    optimizer.register_step_pre_hook(before_step)


def parameter_count(model: torch.nn.Module, layout) -> tuple[int, str]:
    """The registered model's parameters as this process sees them, and what they are of: a
    DTensor counts whole (its numel is the global tensor's), a plain tensor as held."""
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    count = sum(p.numel() for p in params)
    if layout.pp > 1:
        return count, "the last pipeline stage"
    if (layout.tp > 1 or layout.dp_sharded) and not all(isinstance(p, DTensor)
                                                          for p in params):
        return count, "one shard"
    return count, "the model"


def _scale_of(scaler) -> tuple:
    """A GradScaler's scale and growth tracker, copied (None before its first ``scale()``)."""
    return tuple(None if t is None else t.clone()
                 for t in (scaler._scale, scaler._growth_tracker))


class StepLoop:
    """The real step loop of one script run (active worker or joiner)."""

    def __init__(self, rt: Runtime, total: int):
        self.rt, self.ctx, self.total = rt, rt.ctx, total
        rt.loop = self
        cfg = self.ctx.cfg
        self.cfg = cfg
        self.vote: HostVote | CommitVote | None = None
        self.migrations = M.Migrations(rt.name, rt.role, rt.layout, rt.comm_groups,
                                       self.ctx.builder, self.ctx.stores, self.ctx.commands,
                                       self.ctx.events)
        self.migrations.state = rt.state
        self.migrations.settings = cfg.migration
        self.migrations.on_point = lambda point, step: rt.fault_point(point, step)
        self.checkpointer = self._new_checkpointer() if cfg.checkpoint.every else None
        self.snapshotter = PeerSnapshotter(
            rt.role.name, self.ctx.stores.get(), self.ctx.stores.run_key,
            int(os.environ.get("TRAINMOVER_NODE", "0")), cfg.hosts.nnodes,
            cfg.snapshot.connect_timeout_s, cfg.snapshot.io_timeout_s,
            self.ctx.events.emit) if cfg.takes_snapshots() else None
        if self.checkpointer is not None:
            self.checkpointer.on_write = lambda path: self.ctx.fault(
                "checkpoint", self.checkpointer.step)
        self.metrics = JsonlWriter(os.path.join(rt.run_dir, "metrics.jsonl")) \
            if rt.is_reporter else None
        self.on_first_step = None
        self.meter: StepMeter | None = None   # set when the training loop starts
        # (step, generators and GradScaler scales at its start)
        self._rng_start: tuple[int, tuple, list] | None = None
        # the rehearsal (``DataConfig.rehearse``): whether it is to come, and once its
        # first attempt ran, that attempt's batch digest (None: no batch was fingerprinted)
        self._rehearse = cfg.rehearses_data() and self.total > REHEARSAL_STEP
        self._rehearsed: tuple[str | None] | None = None
        self._params_shown = False

    def _new_checkpointer(self) -> AsyncCheckpointer:
        rt = self.rt
        return AsyncCheckpointer(rt.run_dir, rt.role.name, [r.name for r in rt.layout.roles()],
                                 self.ctx.stores.get(), self.cfg.checkpoint.keep)

    # --- where the run starts -----------------------------------------------------------------
    def _start(self) -> int:
        rt, ctx, launch = self.rt, self.ctx, self.ctx.launch
        if isinstance(launch, Start):
            if launch.resume_step:
                t1 = time.perf_counter()
                rt.state.load(load_local(rt.run_dir, launch.resume_step, rt.role.name))
                ctx.events.emit("checkpoint_loaded", step=launch.resume_step,
                                duration_s=round(time.perf_counter() - t1, 4))
            ctx.events.emit("engine_ready",
                            setup_s=round(time.perf_counter() - ctx.t_imported, 4))
            return launch.resume_step
        cmd = launch.command
        if isinstance(cmd, P.AssignRecovery):
            t0 = rt.joining.t_start
            start = R.joiner_restore(ctx, rt.role, cmd, rt.state, rt.joining.channels)
            prepare_s = time.perf_counter() - t0

            def first(step_time_s: float) -> None:
                R.note_recovered(ctx, cmd.recovery_id)
                ctx.events.emit("joiner_started", recovery_id=cmd.recovery_id, step=start,
                                prepare_s=round(prepare_s, 4), source=cmd.source.kind,
                                first_step_s=round(step_time_s, 4))
        else:
            mid = cmd.migration_id
            start, report, held = M.joiner_receive(
                rt.state, rt.joining.channel, rt.joining.precopy,
                on_replay=lambda step: ctx.fault("joiner_precopy", step))
            if held:
                self.migrations.pending_check = M.PrecopyCheck(
                    rt.state, held, ctx.store, P.mig_key(mid, "precopy_sums", rt.role.name),
                    ctx.events, self.cfg.migration.precopy_verify_timeout_s)
            report.update(build_s=rt.joining.build_s,
                          prepare_s=time.perf_counter() - rt.joining.t_start)

            def first(step_time_s: float) -> None:
                M.joiner_started(ctx.store, ctx.events, rt.name, mid, report, start,
                                 step_time_s)
        ctx.fault("joiner_start", start)
        self.on_first_step = first
        return start

    def _start_epoch(self, watching: bool = False) -> None:
        """Arm this epoch's abort watcher (unless ``watching`` already) and commit vote."""
        ctx = self.ctx
        if not self.cfg.health.recover:
            self.vote = None
            return
        if not watching:
            ctx.abort.clear()
            ctx.watch_abort(ctx.epoch)
        reporter = self.rt.name if self.rt.is_reporter else None
        # through the host's agent (one ballot a host: agent/votes.py); a worker no agent
        # started votes in the store itself
        self.vote = HostVote(ctx.inbox, ctx.stores, ctx.epoch, ctx.abort, reporter,
                             ctx.progress, voter=self.rt.name) if ctx.inbox is not None \
            else CommitVote(ctx.stores, self.rt.layout.num_roles, ctx.epoch, reporter,
                            ctx.progress, voter=self.rt.name)

    def _record_key(self, start: int) -> str | None:
        """The structure this worker records step 0 of, if it is that structure's
        representative role and the job has standbys to warm."""
        cfg = self.cfg
        if not (cfg.standby.record and cfg.standby.count > 0 and start == 0):
            return None
        for key, role in representative_roles(cfg.layout, structure_depths(cfg)).items():
            if role == self.rt.role:
                return key
        return None

    # --- the loop --------------------------------------------------------------------------
    def run(self) -> Iterator[int]:
        rt, ctx, cfg = self.rt, self.ctx, self.cfg
        step = start_step = self._start()
        if rt.torch_groups is not None:
            rt.torch_groups.live()     # a joiner's state is in: its next operations are real
        # the stage structure this worker is the representative of (it records step 0 and
        # publishes batch fingerprints for the standbys' warm-up), if any
        self.structure = self._record_key(step)
        record_key = self.structure
        self.recorder = StepRecorder(rt, record_key, self.total) \
            if record_key is not None else None
        if rt.torch_groups is not None:
            pipelining.hook()     # the script has imported what it uses by now
        self._start_epoch()
        if self.checkpointer is not None and step == 0:
            # the initial state: the recovery source of last resort for a role without a
            # replica when no later checkpoint is complete yet (written in the background)
            self.checkpointer.step, self.checkpointer.epoch = None, ctx.epoch
            self.checkpointer.save(0, rt.state.local_state()[0])
        if self.snapshotter is not None and step == 0:
            self.snapshotter.send(0, ctx.epoch, rt.state.local_state()[0])
        tolerant = self.vote is not None
        # the measurements go to the host's agent on the worker's channel (agent/perfs.py)
        self.meter = StepMeter(ctx.inbox.send if ctx.inbox is not None else None, rt.name,
                               rt.role.name, step, cfg.straggler.window,
                               slowdowns(cfg.faults, rt.name),
                               publish=cfg.straggler.policy != "off",
                               cpu_time=cfg.straggler.cpu_measure(ctx.device.type),
                               gpu=ctx.device.index if ctx.device.type == "cuda" else None)
        ctx.progress.arm(True)    # from here the main thread must keep showing progress
        try:
            yield from self._steps(step, start_step, record_key, tolerant)
        finally:
            ctx.progress.arm(False)
        self._finish()

    def _steps(self, step: int, start_step: int, record_key: str | None,
               tolerant: bool) -> Iterator[int]:
        rt, ctx, cfg = self.rt, self.ctx, self.cfg
        again = False     # the rehearsed step's second attempt: no boundary in between
        while step < self.total:
            ctx.progress.tick()
            outcome = self.migrations.at_boundary(step) if not again else None
            if outcome == M.LEAVE:
                ctx.events.emit("worker_left", step=step)
                raise Departed()
            if outcome == M.STOP:
                self._stop(step)
            if step == cfg.baseline.restart_at_step and step != start_step and not again:
                if self.checkpointer is not None:
                    self.checkpointer.wait()  # the checkpoint the restart loads
                ctx.events.emit("worker_stopped_for_restart", step=step)
                rt.comm_groups.shutdown()
                raise Departed()
            rehearsal = self._rehearsal_due(step)
            self.meter.begin(step, rt.comm_groups)
            self._rng_at_start(step)
            if rt.data is not None:
                rt.data.step_started(step)
            recorder = self.recorder.begin(step) if self.recorder is not None else None
            cur = rt.current = StepInFlight(
                step, time.perf_counter(),
                fingerprinted=(self.structure is not None and step in P.FINGERPRINT_STEPS)
                or rehearsal or again, rehearsal=rehearsal)
            rt.fault_point("forward", step)
            ctx.abort.in_step = tolerant
            try:
                yield step
            finally:
                ctx.abort.in_step = False
                rt.current = None
                if recorder is not None:
                    recorder.__exit__(None, None, None)
            if again:
                again = False
                self._check_rehearsal(cur)
            if cur.commit is None:
                if rt.state is None or rt.state.optimizer is None:
                    raise UsageError(
                        f"the step loop skipped the commit point in step {step}: call "
                        f"rt.commit() once per step, before optimizer.step(), or register the "
                        f"optimizer (rt.register(optimizer=...)): its step() commits")
                # the registered optimizer was not stepped (a GradScaler skipped an
                # overflow): the step, which changed nothing, votes here
                cur.metrics = {"loss": None}
                cur.commit = self.vote_on(cur)
            step_time = time.perf_counter() - cur.t_start
            if not cur.commit and self.migrations.pending_check is not None:
                # a recovery may load other state into the copy: nothing left to check
                self.migrations.pending_check = None
                ctx.events.emit("precopy_unverified", level="warning",
                                reason="the first step after the switch was not committed")
            if not cur.commit:
                if cur.rehearsal and not ctx.abort.is_set():
                    self._rehearsed = (cur.batch_digest,)
                    again = True
                    continue
                step = self._recover(step)
                continue
            if rt.data is not None:
                rt.data.step_committed()
            if self.recorder is not None:
                self.recorder.committed(step, recorder, cur.metrics.get("loss"))
            if cur.batch_digest is not None:   # a fingerprinted step (see StepInFlight)
                ctx.store.set(P.batch_fingerprint_key(self.structure, step), cur.batch_digest)
            if self.on_first_step is not None:
                self.on_first_step(step_time)
                self.on_first_step = None
            if self.checkpointer is not None and (step + 1) % cfg.checkpoint.every == 0:
                tensors, _ = rt.state.local_state()
                self.checkpointer.step = step  # the step just completed (fault points key on it)
                self.checkpointer.epoch = ctx.epoch
                sync_s = self.checkpointer.save(step + 1, tensors)
                ctx.events.emit("checkpoint_taken", step=step + 1, sync_s=round(sync_s, 6))
            if self.snapshotter is not None and (step + 1) % cfg.snapshot.every == 0:
                self.snapshotter.send(step + 1, ctx.epoch, rt.state.local_state()[0])
            self.meter.end(step, step_time, rt.comm_groups)
            self.migrations.step_ended(step)
            if self.metrics is not None:
                self._write_metrics(step, step_time, cur.metrics)
            every = cfg.health.verify_every
            if every and (step + 1) % every == 0:
                self._post_digest(step + 1)
            step += 1

    def _rehearsal_due(self, step: int) -> bool:
        """Whether this attempt of ``step`` is the rehearsal's first: the same answer on every
        process of the job (joiners included), as its collectives must be: the first attempt
        of ``REHEARSAL_STEP`` in the job's first epoch (a recovery before it starts another
        epoch, where none is rehearsed)."""
        return (self._rehearse and step == REHEARSAL_STEP and self.ctx.epoch == 0 and
                self._rehearsed is None)

    def _check_rehearsal(self, cur: StepInFlight) -> None:
        """The rehearsed step's second attempt fed the model what its first did, or the
        script's data is not a function of the step (``DataConfig.rehearse``)."""
        (first,), second = self._rehearsed, cur.batch_digest
        if first is None or second is None:
            return     # not the first stage, or its data does not reach a hooked forward
        self.ctx.events.emit("data_rehearsed", step=cur.index, equal=first == second,
                             digests=[first, second])
        if first != second:
            raise DataNotDeterministic(
                f"step {cur.index}'s batch on role {self.rt.role} differs between two "
                f"attempts of the step in the same process (digests {first} and {second}; "
                f"trainmover runs step {REHEARSAL_STEP} twice to check this): the script's "
                f"data must be a pure function of the step, or a redone step and a joiner "
                f"would train on other samples. Likely cause: batches taken from an "
                f"iterator's position (next(it), `for batch in loader`): register the "
                f"loader (batches = rt.register(..., data=loader)) or draw sample positions "
                f"from a generator seeded by the step")

    def _rng_at_start(self, step: int) -> None:
        """A step redone after a failure starts from the generators its first attempt
        started from (``train/rng.py``). After a rollback the state loaded brought its own.
        A registered AMP GradScaler forgets what the abandoned attempt did to it (it had
        unscaled the gradients: ``unscale_()`` would refuse to run again before an
        ``update()``) and gets back its scale from the step's start (a script that commits
        at ``optimizer.step()`` calls ``update()`` in every attempt)."""
        saved = self._rng_start
        if saved is not None and saved[0] == step:
            rng.restore(saved[1])
            self._drop_gradients()
            for scaler, scale in zip(self.rt.scalers, saved[2]):
                _forget_attempt(scaler)
                scaler._scale, scaler._growth_tracker = scale
        else:
            self._rng_start = (step, rng.snapshot(), [_scale_of(s) for s in self.rt.scalers])

    def _drop_gradients(self) -> None:
        """A redone step starts without gradients, as every step does: its first attempt's
        are stale (a script that zeroes them only after a committed ``optimizer.step()``
        would otherwise accumulate them into the redo). A gradient that is a view into
        gradient buckets (the built-in trainer's, ``train/buckets.py``) is zeroed in place
        instead: the buckets' all-reduce reads that memory, not a new tensor."""
        state = self.rt.state
        params = list(state.model.parameters()) if state.model is not None else []
        if state.optimizer is not None:
            params += [p for group in state.optimizer.param_groups for p in group["params"]]
        in_buckets = set()
        if state.buckets is not None:
            in_buckets = {id(p) for p, _ in state.buckets.views}
            state.buckets.zero()
        for p in params:
            if id(p) not in in_buckets:
                p.grad = None

    def _stand_by_for_final(self) -> None:
        """A replica waits until the job's final state is assembled: if the holder of its
        data-parallel-rank-0 role died after the last commit, the controller names it to
        write that role's share instead (the state is the same)."""
        rt, ctx = self.rt, self.ctx
        mine = Role(0, rt.role.pp, rt.role.tp)
        key = P.final_need_key(mine.name)
        digest = os.path.join(final_dir(rt.run_dir), DIGEST_FILE)
        deadline = time.monotonic() + self.cfg.checkpoint.final_timeout_s
        while not os.path.exists(digest) and time.monotonic() < deadline:
            if ctx.store.valid(key) == rt.name.encode():
                ctx.events.emit("final_shard_instead", role=mine.name)
                write_final_shard(rt.run_dir, mine, rt.state, ctx.stores.get(), rt.layout,
                                  self.cfg.checkpoint.final_timeout_s)
                return
            time.sleep(FINAL_WAIT_POLL_S)

    def _post_digest(self, step: int) -> None:
        """This role's state digest before ``step``, for the controller to compare across
        data-parallel replicas (``control/replicas.py``)."""
        if not self.rt.layout.has_replicas:
            return
        digest = state_digest(self.rt.state.entries()[0])
        self.ctx.store.set(P.replica_digest_key(step, self.rt.role.name), digest)

    def vote_on(self, cur: StepInFlight) -> bool:
        """The commit point's decision for the step in flight (see ``Runtime.commit``)."""
        if cur.rehearsal:
            return False    # not committed anywhere: the step runs again (no vote needed)
        if self.meter is not None:
            self.meter.before_vote(cur.index, cur.t_start, self.rt.comm_groups)
        check, self.migrations.pending_check = self.migrations.pending_check, None
        if check is not None:
            check()        # a pre-copied joiner's copy: wrong, it must not vote (raises)
        if self.vote is None:
            return True
        if self.ctx.abort.is_set():
            return False   # doomed: no vote; the controller aborts the step everywhere
        info = {k: v for k, v in cur.metrics.items() if v is not None}
        t_vote, cpu_vote = time.perf_counter(), time.thread_time()
        info["step_time_s"] = t_vote - cur.t_start
        decision = self.vote(cur.index, info)
        if self.meter is not None:
            self.meter.voted(time.perf_counter() - t_vote, time.thread_time() - cpu_vote)
        return decision

    def _write_metrics(self, step: int, step_time: float, metrics: dict) -> None:
        record = {"step": step, **metrics, "step_time_s": round(step_time, 6)}
        if not self._params_shown and not self.cfg.process.builtin and \
                isinstance(self.ctx.launch, Start) and self.rt.state.model is not None:
            # what the launch banner cannot know: the script's model (the controller shows it)
            self._params_shown = True
            record["model_params"], record["model_params_of"] = parameter_count(
                self.rt.state.model, self.rt.layout)
        if self.rt.tokens_per_step:
            record["tokens_per_s"] = round(self.rt.tokens_per_step / step_time, 1)
        record["worker"] = self.rt.name
        record["epoch"] = self.ctx.epoch   # a resumed controller's committed count (resume)
        self.metrics.write(record)

    def _recover(self, step: int) -> int:
        rt, ctx = self.rt, self.ctx
        error = ctx.abort.reason or f"step {step} was aborted by the job"
        # the generators back to the step's start before this role's state may be sent to a
        # joiner (as a replica): the joiner redoes the step from them too
        self._rng_at_start(step)
        resume, _ = R.survive(ctx, rt.role, rt.comm_groups, rt.state, self.migrations, step,
                              error)
        self._start_epoch(watching=True)
        return resume

    def _stop(self, step: int) -> None:
        """A graceful stop at ``step``: the checkpoint taken before it (unless the periodic
        one just was), written before the process exits; ``Departed`` ends the script."""
        rt, ctx = self.rt, self.ctx
        ck = self.checkpointer or self._new_checkpointer()
        ck.wait()
        if ck.saved_step != step:
            ck.step, ck.epoch = None, ctx.epoch
            ck.save(step, rt.state.local_state()[0])
            ck.wait()
        ctx.events.emit("worker_stopped", step=step)
        rt.comm_groups.shutdown()
        raise Departed()

    def _finish(self) -> None:
        rt, ctx = self.rt, self.ctx
        if self.checkpointer is not None:
            self.checkpointer.wait()
        # every step is committed: a failure from here on needs no recovery (the
        # controller sees this key), only someone to write the final state
        ctx.store.set(P.finished_key(rt.name), "1")
        self._post_digest(self.total)
        if rt.layout.holds_final_share(rt.role):
            write_final_shard(rt.run_dir, rt.role, rt.state, ctx.stores.get(), rt.layout,
                              self.cfg.checkpoint.final_timeout_s)
        else:
            self._stand_by_for_final()
        ctx.events.emit("worker_done", steps=self.total)
        # the groups stay up until the script returns (``Runtime.close``): code after the
        # loop (a DCP save, an evaluation) runs its collectives on them
        rt.finished = True
