"""The API a training script calls: ``trainmover.init()`` and the ``Runtime`` it returns.

    rt = trainmover.init()                   # role, groups, device of this worker
    model = rt.data_parallel(model)          # instead of DistributedDataParallel
    rt.register(model=model, optimizer=opt)  # what moves to a joiner and into checkpoints
    for step in rt.steps(max_steps):         # the step index is the data position
        ...forward, backward...
        if rt.commit(loss=loss.item()):      # no step is ever half-applied
            opt.step()

The explicit ``rt.commit()`` may be left out: the registered optimizer's ``step()`` is then
the commit point (``loop.guard_optimizer``), and does nothing in a step that is not
committed; a step whose optimizer is not stepped (a GradScaler skipping an overflow) votes
at its end.

Everything else is the runtime's: planned migrations (this worker may stay, leave or join),
the standby's sandboxed warm-up (the same script runs against recorded communication),
failure detection and recovery, the commit vote, checkpoints, metrics and the final state.

How a step ends. ``commit`` is the step's commit point: every collective of the step comes
before it, the optimizer after it. It votes on the job's store; when every worker voted the
step is committed and ``commit`` returns True. If anything failed during the step (a peer
crashed or hung, an operation failed, the controller aborted the step), the step is
*doomed*: the rest of its communication returns at once without touching the network (so
the script's code runs on, on values that will be thrown away), ``commit`` returns False,
and the next turn of ``steps()`` recovers: it reports, carries out the controller's plan,
and yields the step to redo (the same step, or an earlier one after a checkpoint rollback).
A leaver's ``steps()`` hands its state over at the switch boundary and ends the script run
(``Departed``, a ``BaseException``); a standby's shadow run ends with ``ShadowDone``.
"""
from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Iterator

import torch

from trainmover.comm.groups import Group, build_comm_groups
from trainmover.comm import pipelining
from trainmover.comm.record import load_into, load_recording, rewind, sandbox_groups
from trainmover.core import protocol as P
from trainmover.core.identity import DATA_KEY, data_mismatch
from trainmover.core.config import JobConfig
from trainmover.core.topology import Layout, Role, reporter_role
from trainmover.train.ddp import DataParallel
from trainmover.train.loader import DataUnsupported, RegisteredData
from trainmover.train.state import TrainState
from trainmover.worker import context as context_mod
from trainmover.worker import migration as M
from trainmover.worker import recover as R
from trainmover.worker.context import Join, Shadow, Start, WorkerContext
from trainmover.worker.errors import DataNotDeterministic, UsageError
from trainmover.worker.handles import GroupView
from trainmover.worker.loop import StepInFlight, StepLoop, guard_optimizer
from trainmover.worker.recording import stage_initialisations


class ShadowDone(BaseException):
    """Ends a standby's shadow run once its warm-up iterations are done (not an error)."""


class ShadowInterrupted(ShadowDone):
    """Ends a shadow run early: the standby was assigned a role before the structure it was
    warming had been recorded."""


def init() -> "Runtime":
    """This worker's runtime. Call once per run of the script, before building the model."""
    ctx = context_mod.current()
    if ctx is None:
        raise UsageError("trainmover.init() must run in a process started by `trainmover "
                         "launch ... -- python SCRIPT` (or `trainmover run`)")
    if ctx.runtime is not None:
        raise UsageError("trainmover.init() was called twice in one run of the script")
    rt = Runtime(ctx)
    ctx.runtime = rt
    return rt


@dataclass
class Joining:
    """A joiner's run: the channel its state arrives on, and when its preparation began."""

    channel: Group | None
    t_start: float
    build_s: float = 0.0
    precopy: bool = False   # the leaver pre-copies its state (``joiner_allocate``)
    # a recovery's channels from the replicas sending the state, share 0 first
    channels: list = field(default_factory=list)


class Runtime:
    """One worker's view of the job for one run of the training script (see module doc)."""

    def __init__(self, ctx: WorkerContext):
        self.ctx = ctx
        self.config: JobConfig = ctx.cfg
        self.layout: Layout = ctx.cfg.layout
        self.name, self.device, self.run_dir = ctx.name, ctx.device, ctx.run_dir
        launch = ctx.launch
        self.sandbox = isinstance(launch, Shadow)
        self.state: TrainState | None = None
        self.tokens_per_step: int | None = None   # set by the script for tokens/s in metrics
        self.finished = False
        self.current: StepInFlight | None = None   # None between steps
        self.joining: Joining | None = None
        self.loop: StepLoop | None = None            # a real (not shadow) run's step loop
        self._wrappers: list[DataParallel] = []
        self.scalers: list = []     # AMP GradScalers registered as extra state (see StepLoop)
        self.data: RegisteredData | None = None    # rt.register(data=...)
        t_init = time.perf_counter()
        if isinstance(launch, Shadow):
            self.role = launch.role
            self.comm_groups = sandbox_groups(self.layout, self.role, None, self.device)
        elif isinstance(launch, Start):
            self.role = Role.parse(ctx.store.get(P.membership_key(ctx.name)).decode())
            t0 = time.perf_counter()
            gens = {s.name: launch.generation
                    for s in self.layout.groups_of(self.role).values()}
            self.comm_groups, times = build_comm_groups(ctx.builder, self.layout, self.role,
                                                        gens)
            ctx.events.emit("groups_built", generation=launch.generation,
                            duration_s=round(time.perf_counter() - t0, 4),
                            groups={k: round(v, 4) for k, v in times.items()})
        else:
            cmd = launch.command
            self.role = Role.parse(cmd.role)
            ctx.fault("joiner_prepare")
            channels = []
            if isinstance(cmd, P.AssignRecovery):
                self.comm_groups, channels = R.joiner_build(ctx, self.role, cmd)
                channel = channels[0] if channels else None
            else:
                # the job's current failure epoch (each recovery starts one): the joiner
                # votes and watches for aborts in it, never in an epoch aborted before it
                ctx.epoch = cmd.epoch
                self.comm_groups, channel, _ = M.joiner_build(
                    ctx.builder, self.layout, self.role, cmd)
            self.joining = Joining(channel, t_init, time.perf_counter() - t_init,
                                   channels=channels)
        ctx.events.fixed["role"] = self.role.name
        self.torch_groups = self._torch_groups() if ctx.cfg.has_torch_groups() else None
        self.groups = GroupView(self.comm_groups, self.torch_groups)
        self.is_reporter = self.role == reporter_role(self.layout) and not self.sandbox

    def _torch_groups(self):
        """The script's torch.distributed process groups (``comm/torch_groups.py``): a
        standby's shadow run answers them locally; a joiner's set-up too, until its first
        step."""
        from trainmover.comm.torch_groups import TorchGroups

        groups = TorchGroups(self.comm_groups, self.layout, self.role, self.ctx.abort,
                             self.device, sandbox=self.sandbox,
                             joining=isinstance(self.ctx.launch, Join))
        groups.emit = self.ctx.events.emit
        if groups.joiner:
            groups.init_source = lambda: stage_initialisations(self)
        return groups

    def device_mesh(self, axes: tuple[str, ...] | None = None):
        """A ``torch.distributed.DeviceMesh`` over this worker's process groups, dimensions
        named "dp", "pp", "tp" (or the ``axes`` given): for FSDP2 (``fully_shard(m,
        mesh=...)``), DTensor and ``parallelize_module``. Its groups move with the job."""
        if self.torch_groups is None:
            raise UsageError("rt.device_mesh() needs torch process groups: comm.torch_groups "
                             "is 'off' for this job")
        return self.torch_groups.device_mesh(axes)

    def _mesh_axes(self, mesh) -> list[str | None]:
        """The job axis of each dimension of a DeviceMesh: by name ("dp", "pp", "tp"), else
        by which of this worker's process groups the dimension is."""
        names = list(mesh.mesh_dim_names or [None] * mesh.ndim)
        groups = self.torch_groups.process_groups if self.torch_groups is not None else {}
        out = []
        for i, name in enumerate(names):
            if name not in ("dp", "pp", "tp"):
                group = mesh.get_group(i)
                name = next((a for a, pg in groups.items() if pg is group and a != "world"),
                            None)
                if name is None and groups.get("world") is group and \
                        self.torch_groups.world_axis is not None:
                    name = self.torch_groups.world_axis
            out.append(name)
        return out

    def close(self) -> None:
        """The end of this run of the script (the worker's, between runs)."""
        if self.torch_groups is not None:
            self.torch_groups.close()
            self.ctx.replay_mismatch = self.torch_groups.replay_mismatch
            self.torch_groups = None
        if self.finished:
            self.comm_groups.shutdown()

    # --- where this worker is --------------------------------------------------------------
    @property
    def dp_rank(self) -> int:
        return self.role.dp

    @property
    def dp_size(self) -> int:
        return self.layout.dp

    @property
    def pp_rank(self) -> int:
        return self.role.pp

    @property
    def pp_size(self) -> int:
        return self.layout.pp

    @property
    def tp_rank(self) -> int:
        return self.role.tp

    @property
    def tp_size(self) -> int:
        return self.layout.tp

    @property
    def is_main(self) -> bool:
        """Whether this process should log, report and write the script's own files: the
        holder of the role that records metrics (data- and tensor-parallel rank 0 of the last
        stage, which holds the loss), and never a standby's warm-up. Guard ``wandb.init``,
        printing and the script's own checkpoints with it: a standby rehearses the script
        with ``is_main`` False, and a promoted one holding that role gets True."""
        return self.is_reporter

    @property
    def is_first_stage(self) -> bool:
        return self.role.pp == 0

    @property
    def is_last_stage(self) -> bool:
        return self.role.pp == self.layout.pp - 1

    # --- the model and its state -------------------------------------------------------------
    def declare_data(self, sha256: str, description: str = "the data") -> None:
        """The digest of the data this process trains on (e.g. of its token files). The first
        process of the job to declare sets the job's; any other process (a joiner started
        later, a resumed job) that declares another is refused with ``IdentityMismatch``,
        before it trains or warms up on other tokens."""
        if not isinstance(sha256, str) or not sha256:
            raise UsageError(f"rt.declare_data(sha256): a non-empty string, got {sha256!r}")
        job = self.ctx.store.compare_set(DATA_KEY, "", sha256).decode()
        if job != sha256:
            raise data_mismatch(self.name, job, sha256, description)

    def data_parallel(self, module: torch.nn.Module, bucket_mb: float = 25.0) -> DataParallel:
        """Wrap ``module`` for data-parallel training over this worker's replicas (the
        runtime's ``DistributedDataParallel``; see ``train/ddp.py``)."""
        # the first stage's model input is the step's data (a later stage's is activations,
        # which in a shadow run are the recording's): fingerprint it there
        on_forward = (lambda args, kwargs: self.fingerprint(args)) \
            if self.is_first_stage else None
        wrapper = DataParallel(module, self.comm_groups, bucket_mb, on_forward=on_forward,
                               on_point=lambda point: self.fault_point(point))
        if isinstance(self.ctx.launch, Start):
            # as DDP: one model whatever each rank seeded. Not in a shadow run (no peers) or
            # a joiner (its state arrives from the leaver or a replica, mid-training)
            wrapper.align(self.comm_groups)
        self._wrappers.append(wrapper)
        return wrapper

    def register(self, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, extra: dict | None = None,
                 buckets=None, data=None) -> RegisteredData | None:
        """Declare the training state: the model's parameters and buffers, the optimizer's
        state and settings, and ``extra`` (tensors, JSON values, or objects with
        ``state_dict``; a dict updated in place when state arrives). It is what a joiner
        receives and what checkpoints hold; RNG states and the step come with it.
        ``data``: a stateful loader (``state_dict``/``load_state_dict``, e.g. torchdata's
        ``StatefulDataLoader``) whose position is state too; iterate what this returns for
        it (``rt.batches()``, ``train/loader.py``)."""
        if self.state is not None:
            raise UsageError("rt.register() was called twice")
        if model is None and optimizer is None and not extra and data is None:
            raise UsageError("rt.register() needs a model, an optimizer or extra state")
        if data is not None:
            if extra and "data" in extra:
                raise UsageError("rt.register(data=...) keeps the loader's position as the "
                                 "extra entry 'data': rename the script's own 'data' entry")
            try:
                self.data = RegisteredData(data)
            except DataUnsupported as exc:
                raise UsageError(str(exc)) from exc
            extra = {**(extra or {}), "data": self.data}
        if buckets is None:
            for w in self._wrappers:
                if model is w or model is w.module:
                    buckets = w.buckets
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            _fix_ddp_buckets(model)
        wrapped = any(model is w or model is w.module for w in self._wrappers)
        if isinstance(model, torch.nn.Module) and self.is_first_stage and not wrapped:
            # the step's data, as the first stage's model gets it (a data_parallel wrapper
            # fingerprints its own input): for the checks of ``fingerprint``
            model.register_forward_pre_hook(
                lambda module, args, kwargs: self.fingerprint((args, kwargs)),
                with_kwargs=True)
        self.state = TrainState(model, optimizer, extra, buckets, axes_of=self._mesh_axes)
        self.scalers = [v for v in (extra or {}).values() if isinstance(v, torch.amp.GradScaler)]
        if optimizer is not None:
            guard_optimizer(self, optimizer)
        sharded = self.state.dp_dims()
        if sharded and not self.layout.dp_sharded:
            raise UsageError(
                f"the registered state is sharded over the data-parallel axis (e.g. "
                f"{next(iter(sharded))!r}: FSDP2 or ZeRO), so the dp roles are not replicas "
                f"of each other: launch with --dp-sharded (layout.dp_sharded)")
        launch = self.ctx.launch
        if isinstance(launch, (Join, Shadow)) and self.torch_groups is not None:
            # before the switch: off the downtime; and in a standby's later warm-up runs,
            # whose cached sharding decisions would hold an earlier run's destroyed groups
            self.torch_groups.rebind_meshes()
        if isinstance(launch, Join) and isinstance(launch.command, P.AssignMigration):
            self.joining.precopy = M.joiner_allocate(self.state, self.joining.channel,
                                                     self.ctx.events,
                              launch.command.migration_id)
            M.joiner_ready(self.ctx.store, self.ctx.events, self.name,
                           launch.command.migration_id, self.joining.build_s,
                           time.perf_counter() - self.joining.t_start)
        return self.data

    def batches(self) -> RegisteredData:
        """The registered loader's batches (``rt.register(data=loader)``): iterate this
        instead of the loader, so a redone step gets its first attempt's batches."""
        if self.data is None:
            raise UsageError("rt.batches() iterates the loader given as rt.register(data=...)"
                             ": register one first")
        return self.data

    def fingerprint(self, batch) -> None:
        """Declare the step's data (tensors, or lists/dicts of them): kept to check that the
        data is a pure function of the step. ``data_parallel`` wrappers call it with the
        first stage's model input, the built-in engine with its tokens; a script whose data
        reaches the model otherwise can call it itself. The first call of a step counts."""
        cur = self.current
        if cur is None or not cur.fingerprinted or cur.batch_digest is not None:
            return
        h = hashlib.sha256()
        for t in _tensors_in(batch):
            t = t.detach().cpu().contiguous()
            h.update(f"{t.dtype}|{tuple(t.shape)}|".encode())
            h.update(t.numpy().tobytes() if t.dtype != torch.bfloat16 else
                     t.view(torch.int16).numpy().tobytes())
        cur.batch_digest = h.hexdigest()[:16]

    def fault_point(self, point: str, step: int | None = None) -> None:
        """A named point of a step where tests and chaos runs inject faults."""
        if self.sandbox:
            return
        if step is None and self.current is not None:
            step = self.current.index
        self.ctx.fault(point, step, on_commerr=self._commerr)

    def _commerr(self) -> None:
        for g in self.comm_groups.slots().values():
            if g.size > 1:
                g.abort()

    # --- the step loop ---------------------------------------------------------------------
    def steps(self, total: int) -> Iterator[int]:
        """Yields the steps to run, from where this worker's role is (0, a restart's or a
        joiner's step), to ``total``; may yield a step again after a failure. The step is
        the data position: the script's batch must be a pure function of it."""
        if self.state is None:
            raise UsageError("register the training state (rt.register(model=..., "
                             "optimizer=...)) before the first step")
        if not isinstance(total, int) or total < 1:
            raise UsageError(f"rt.steps(total): total must be a positive integer, got "
                             f"{total!r}")
        if self.sandbox:
            yield from self._shadow_steps()
            return
        yield from StepLoop(self, total).run()

    def commit(self, loss: float | None = None, **metrics) -> bool:
        """The step's commit point, after its last collective and before the optimizer:
        True once every worker voted to commit the step (apply it); False if the step failed
        anywhere (do not apply it; the next turn of ``steps()`` recovers). ``loss`` and other
        numbers given are recorded in metrics.jsonl by the worker holding the loss."""
        cur = self.current
        if cur is None:
            raise UsageError("rt.commit() called outside a step of rt.steps()")
        if cur.commit is not None:
            raise UsageError(f"rt.commit() called twice in step {cur.index}")
        cur.metrics = {"loss": loss, **metrics}
        cur.commit = self.loop.vote_on(cur) if self.loop is not None else True
        if cur.commit:
            self.fault_point("optimizer")
        return cur.commit

    def _shadow_steps(self) -> Iterator[int]:
        """A standby's warm-up: real steps of this structure's role against the recording
        (step 0's communication, replayed: shapes and realistic values, which is all the
        warm-up needs), the same code as a real step; then the run ends. It runs steps 1, 2,
        ... as a joiner starts at a step after 0, and checks their batches against the ones
        the job's worker of that role fed (``FINGERPRINT_STEPS``)."""
        launch, ctx = self.ctx.launch, self.ctx
        t_wait = time.perf_counter()
        while not os.path.exists(launch.path):
            if not ctx.commands.queue.empty():
                raise ShadowInterrupted(f"assigned before {launch.structure} was recorded")
            time.sleep(ctx.cfg.standby.recording_poll_s)
        ctx.shadow_wait_s = time.perf_counter() - t_wait
        rec = load_recording(launch.path, launch.manifest)
        load_into(self.comm_groups, rec)
        if self.torch_groups is not None:
            pipelining.hook()
        for i in range(ctx.cfg.standby.warmup_iterations):
            step = i + 1
            rewind(self.comm_groups)
            if self.torch_groups is not None and rec.torch_ops:
                # torch's first step differs from the next (worker/recording.py)
                self.torch_groups.load_replay(rec.torch_ops[min(i, len(rec.torch_ops) - 1)])
            cur = self.current = StepInFlight(step, time.perf_counter(),
                                              fingerprinted=step in P.FINGERPRINT_STEPS)
            try:
                yield step
            finally:
                self.current = None
            ctx.shadow_times.append(time.perf_counter() - cur.t_start)
            if cur.commit is None and (self.state is None or self.state.optimizer is None):
                raise UsageError("the step loop skipped the commit point: call rt.commit() "
                                 "once per step, before optimizer.step(), or register the "
                                 "optimizer (rt.register(optimizer=...)): its step() commits")
            self._check_fingerprint(launch.structure, cur)
            why = self.torch_groups.mismatch() if self.torch_groups is not None else None
            if why:
                # the rest of that step ran on local answers: warm, but not on real values
                ctx.events.emit("replay_diverged", structure=launch.structure, step=step,
                                reason=why, level="warning")
            if not ctx.commands.queue.empty():
                break
        raise ShadowDone()

    def _check_fingerprint(self, structure: str, cur: StepInFlight) -> None:
        step = cur.index
        if step not in P.FINGERPRINT_STEPS or cur.batch_digest is None:
            return
        if self.data is not None:
            # the position is the registered loader's, which travels with the role: a
            # standby's rehearsal draws from its own, and is not the job's batch
            return
        key = P.batch_fingerprint_key(structure, step)
        if self.ctx.store.check([P.RESUMED_KEY]):
            self.ctx.events.emit("fingerprint_skipped", step=step, structure=structure,
                                 reason="resumed job")
            return
        try:
            self.ctx.store.wait([key], timedelta(seconds=self.config.standby.fingerprint_wait_s))
        except Exception:  # noqa: BLE001 - the job has not run that step yet (or ended)
            self.ctx.events.emit("fingerprint_skipped", step=step, structure=structure)
            return
        expected = self.ctx.store.valid(key)
        if expected is None:          # forged: nothing to compare with
            self.ctx.events.emit("fingerprint_skipped", step=step, structure=structure)
            return
        expected = expected.decode()
        if expected != cur.batch_digest:
            raise DataNotDeterministic(
                f"step {step}'s batch on role {self.role} differs between the job (digest "
                f"{expected}) and this standby's run of that step (digest "
                f"{cur.batch_digest}): the script's data must be a pure function of the "
                f"step (e.g. sample positions from a generator seeded by the step, not an "
                f"iterator's state), or a joiner would train on other samples")


def _fix_ddp_buckets(ddp: torch.nn.parallel.DistributedDataParallel) -> None:
    """Fix a DDP module's gradient buckets now, the same on every process of the job.

    Why: DDP lays its buckets out once more after its first backward, in the order that
    backward produced gradients, and agrees on it with a broadcast. A joiner's DDP is new
    while the stayers' rebuilt long ago: its first steps would all-reduce buckets laid out
    otherwise (mixing up parameters) and then broadcast alone. Rebuilding here, from the
    parameters' order, before any step, gives every process (first start, joiner, restart)
    one layout and no later rebuild. (Uses the reducer's own rebuild entry points; the cost
    is that buckets no longer follow the backward order, so less of the all-reduce overlaps
    the backward.)"""
    reducer = ddp.reducer
    reducer._push_all_rebuilt_params()
    reducer._rebuild_buckets()


def _tensors_in(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors_in(o)
    elif isinstance(obj, dict):
        for k in sorted(obj):
            yield from _tensors_in(obj[k])
