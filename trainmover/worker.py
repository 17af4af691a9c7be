"""A worker process: holds one role (or waits as a standby), trains, reports.

Started by the coordinator as ``python -m trainmover.worker --run-dir DIR --name w3 --store
HOST:PORT`` (``--standby`` for a standby). An active worker's role comes from the membership
table in the store, not from its name; a standby learns its role from an ``assign`` command.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

T_START = time.perf_counter()

import torch  # noqa: E402  (import time is measured)

from . import faults  # noqa: E402
from . import protocol as P  # noqa: E402
from .comm import (CommGroups, GroupBuilder, StoreAddress, StoreClients,  # noqa: E402
                   build_comm_groups)
from .config import JobConfig  # noqa: E402
from .data import BatchSource, load_tokens  # noqa: E402
from .engine import Engine  # noqa: E402
from .events import EventLog, JsonlWriter  # noqa: E402
from .runtime import LEAVE, CommandChannel, WorkerRuntime, rss_mb, transfer_spec  # noqa: E402
from .checkpoint import AsyncCheckpointer, load_local  # noqa: E402
from .comm import AbortSignal, StepAborted  # noqa: E402
from .failure import AbortWatcher, CommitVote, Heartbeat, is_step_failure  # noqa: E402
from .record import (Recorder, RecordingInvalid, SandboxMismatch, load_recording,  # noqa: E402
                     manifest_for, recording_dir, recording_path, representative_roles,
                     rewind, sandbox_groups, save_recording, structure_key)
from .state import apply_local_state, local_state  # noqa: E402
from .topology import Role  # noqa: E402
from .transfer import recv_state, send_state  # noqa: E402


def reporter_role(cfg: JobConfig) -> Role:
    """The role that writes metrics.jsonl: it holds the loss (last stage) and is unique."""
    return Role(0, cfg.layout.pp - 1, 0)


def save_atomic(obj, path: str) -> None:
    """Write then rename, so a reader never sees a partial file."""
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


class Worker:
    def __init__(self, run_dir: str, name: str, store_addr: StoreAddress):
        self.t_imported = time.perf_counter()
        self.run_dir, self.name = run_dir, name
        with open(os.path.join(run_dir, "job.json")) as f:
            self.cfg = cfg = JobConfig.from_dict(json.load(f))
        torch.set_num_threads(cfg.threads_per_worker())
        self.stores = StoreClients(store_addr, timeout_s=cfg.runtime.group_timeout_s)
        self.store = self.stores.get()
        self.events = EventLog(os.path.join(run_dir, "events.jsonl"), worker=name)
        self.device = self._device()
        self.abort = AbortSignal()
        self.epoch = 0
        self.builder = GroupBuilder(self.stores, self.device, cfg.runtime.group_timeout_s,
                                    abort_signal=self.abort if cfg.runtime.recover else None)
        self.heartbeat = Heartbeat(self.stores, name, cfg.runtime.heartbeat_interval_s) \
            if cfg.runtime.recover else None
        self.commands = CommandChannel(self.stores, name)
        self.data = load_tokens(cfg.data)
        self.events.emit("worker_started", pid=os.getpid(),
                         import_s=round(self.t_imported - T_START, 4))

    def _device(self) -> torch.device:
        if self.cfg.runtime.device != "cuda":
            return torch.device("cpu")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())

    def make_engine(self, role: Role, groups: CommGroups) -> Engine:
        cfg = self.cfg
        batches = BatchSource(self.data, cfg.model.seq_len, cfg.train.global_batch,
                              cfg.train.seed, cfg.model.vocab_size)
        return Engine(cfg, role, groups, batches, self.device)

    # --- an active worker from the start ---------------------------------------------------
    def run_active(self, resume_step: int = 0, generation: int = 0) -> None:
        """Start training at step 0, or (a restarted process) at ``resume_step`` from the
        role's checkpoint, on groups of ``generation``."""
        role = Role.parse(self.store.get(P.membership_key(self.name)).decode())
        self.events.fixed["role"] = role.name
        t0 = time.perf_counter()
        gens = {name: generation for name in self.cfg.layout.communicator_groups()}
        groups, build_times = build_comm_groups(self.builder, self.cfg.layout, role, gens)
        self.events.emit("groups_built", generation=generation,
                         duration_s=round(time.perf_counter() - t0, 4),
                         groups={k: round(v, 4) for k, v in build_times.items()})
        engine = self.make_engine(role, groups)
        if resume_step:
            t1 = time.perf_counter()
            apply_local_state(engine.model, engine.optimizer,
                              load_local(self.run_dir, resume_step, role.name))
            self.events.emit("checkpoint_loaded", step=resume_step,
                             duration_s=round(time.perf_counter() - t1, 4))
        self.events.emit("engine_ready", setup_s=round(time.perf_counter() - self.t_imported, 4),
                         params=sum(p.numel() for p in engine.params))
        self.train(role, groups, engine, start_step=resume_step)

    def _record_step(self, engine: Engine, groups: CommGroups, key: str, role: Role, vote):
        """Run one real step with the communication recorder in place, then save it."""
        with Recorder(groups) as recorder:
            result = engine.train_step(0, commit=vote)
        t0 = time.perf_counter()
        rec = recorder.recording(manifest_for(self.cfg, key, role))
        rec.manifest.update(record_step=0, bytes=rec.nbytes, loss=result.loss)
        path = recording_path(recording_dir(self.cfg, self.run_dir), key)
        save_s = save_recording(rec, path)
        self.events.emit("recorded", structure=key, path=path, bytes=rec.nbytes,
                         ops=sum(len(v) for v in rec.ops.values()),
                         record_s=round(time.perf_counter() - t0, 4), save_s=round(save_s, 4))
        return result

    # --- a standby: wait, then join ----------------------------------------------------------
    def run_standby(self) -> None:
        self._set_standby_state("cold")
        self.events.emit("standby_registered", state="cold")
        faults.hit(self.cfg.runtime.faults, self.name, "standby", store=self.store,
                   events=self.events)
        warm = self.warm_up() if self.cfg.runtime.warmup else None
        cmd = self.commands.next()
        if cmd["type"] != "assign":
            raise RuntimeError(f"standby {self.name}: expected an assign command, got {cmd}")
        del warm  # the shadow engine's memory goes back to the allocator for the real one
        if "recovery_id" in cmd:
            return self._join_recovery(cmd)
        role = Role.parse(cmd["role"])
        self.events.fixed["role"] = role.name
        mid = cmd["migration_id"]
        # the job's current failure epoch (each recovery starts one): the joiner votes and
        # watches for aborts in it, never in an epoch that was aborted before it joined
        self.epoch = cmd["epoch"]
        faults.hit(self.cfg.runtime.faults, self.name, "joiner_prepare", store=self.store,
                   events=self.events)
        t0 = time.perf_counter()
        # Phase 1: build the role's groups at their new generations and the transfer channel,
        # in the one global name order every participant uses.
        gens = cmd["groups"]
        specs = self.cfg.layout.groups_of(role)
        built = {}
        todo = sorted([(s.name, s) for s in specs.values()] +
                      [(cmd["transfer_group"], transfer_spec(cmd["transfer_group"], role))])
        for name, spec in todo:
            if spec.kind == "xfer":
                built[name] = self.builder.build_ranked(spec, 1, cmd["transfer_generation"])
            else:
                built[name] = self.builder.build(spec, role, gens.get(name, 0))
        channel = built.pop(cmd["transfer_group"])
        groups = CommGroups.from_groups(role, self.cfg.layout, built)
        build_s = time.perf_counter() - t0
        engine = self.make_engine(role, groups)
        prepare_s = time.perf_counter() - t0
        self.store.set(P.mig_key(mid, "ready", self.name),
                       P.encode({"build_s": build_s, "prepare_s": prepare_s}))
        self.store.add(P.mig_key(mid, "ready_count"), 1)
        self.events.emit("joiner_ready", migration_id=mid, build_s=round(build_s, 4),
                         prepare_s=round(prepare_s, 4))
        # Phase 2: the leaver sends its state at the switch boundary; that step is ours next.
        t_recv = time.perf_counter()
        start_step, got = recv_state(engine, channel, 0)
        recv_s = time.perf_counter() - t_recv
        channel.shutdown()
        report = {"recv_s": recv_s, "transfer_s": got["seconds"], "transfer_bytes": got["bytes"],
                  "build_s": build_s, "prepare_s": prepare_s}

        def on_first_step(result) -> None:
            report["first_step_s"] = result.step_time_s
            report["rss_after"] = rss_mb()
            self.store.set(P.mig_key(mid, "switched", self.name), P.encode(report))
            self.store.add(P.mig_key(mid, "switched_count"), 1)
            self.events.emit("joiner_started", migration_id=mid, step=start_step,
                             first_step_s=round(result.step_time_s, 4), recv_s=round(recv_s, 4))

        self.train(role, groups, engine, start_step, on_first_step)

    def _join_recovery(self, cmd: dict) -> None:
        """Take a failed worker's role: build its groups (at the generations the plan gives)
        and take its state from a live data-parallel replica or from the checkpoint."""
        role = Role.parse(cmd["role"])
        self.events.fixed["role"] = role.name
        rid, source = cmd["recovery_id"], cmd["source"]
        faults.hit(self.cfg.runtime.faults, self.name, "joiner_prepare", store=self.store,
                   events=self.events)
        t0 = time.perf_counter()
        specs = {s.name: s for s in self.cfg.layout.groups_of(role).values()}
        if source["kind"] == "replica":
            specs[source["transfer_group"]] = transfer_spec(source["transfer_group"], role)
        built = {}
        for name, spec in sorted(specs.items()):
            if spec.kind == "xfer":
                built[name] = self.builder.build_ranked(spec, 1, source["transfer_generation"])
            else:
                built[name] = self.builder.build(spec, role, cmd["groups"].get(name, 0))
        channel = built.pop(source.get("transfer_group"), None)
        groups = CommGroups.from_groups(role, self.cfg.layout, built)
        engine = self.make_engine(role, groups)
        if channel is not None:
            start_step, got = recv_state(engine, channel, 0)
            channel.shutdown()
        else:
            start_step = source["step"]
            apply_local_state(engine.model, engine.optimizer,
                              load_local(self.run_dir, start_step, role.name))
        if start_step != cmd["resume_step"]:
            raise RuntimeError(f"{self.name}: state for step {start_step}, expected "
                               f"{cmd['resume_step']}")
        self.epoch = cmd["epoch"]
        prepare_s = time.perf_counter() - t0

        def on_first_step(result) -> None:
            self.store.add(P.recovery_key(rid, "recovered_count"), 1)
            self.events.emit("joiner_started", recovery_id=rid, step=start_step,
                             prepare_s=round(prepare_s, 4), source=source["kind"],
                             first_step_s=round(result.step_time_s, 4))

        self.train(role, groups, engine, start_step, on_first_step)

    def _set_standby_state(self, state: str, warm_for: list[str] = ()) -> None:
        self.store.set(P.standby_state_key(self.name), state)
        self.store.set(P.standby_state_key(self.name) + "/warm_for", P.encode(list(warm_for)))

    def warm_up(self) -> Engine | None:
        """General standby: run shadow iterations of every stage structure (first, last,
        then middle) on recorded communication; keep the last engine built (a middle role's
        where there is one). Stops early when an assignment arrives; a missing, unreadable
        or stale recording leaves that structure cold, with a warning, and nothing else."""
        cfg = self.cfg
        directory = recording_dir(cfg, self.run_dir)
        warmed: list[str] = []
        engine = None
        self._set_standby_state("warming")
        for key, role in representative_roles(cfg.layout, cfg.model.n_layers).items():
            path = recording_path(directory, key)
            while not os.path.exists(path):
                if not self.commands.queue.empty():
                    self.events.emit("warmup_interrupted", structure=key, warmed=warmed)
                    return engine
                time.sleep(0.05)
            t0 = time.perf_counter()
            try:
                rec = load_recording(path, manifest_for(cfg, key, role))
                engine = None
                groups = sandbox_groups(cfg.layout, role, rec, self.device)
                engine = self.make_engine(role, groups)
                times = []
                for i in range(cfg.runtime.warmup_iterations):
                    rewind(groups)
                    times.append(engine.train_step(i).step_time_s)
            except (RecordingInvalid, SandboxMismatch) as exc:
                self.events.emit("warmup_skipped", structure=key, reason=str(exc),
                                 level="warning")
                print(f"warning: {self.name} cannot warm {key} ({exc}); it stays cold for it",
                      file=sys.stderr, flush=True)
                continue
            warmed.append(key)
            self._set_standby_state("warming", warmed)
            self.events.emit("warmed", structure=key, role=role.name,
                             duration_s=round(time.perf_counter() - t0, 4),
                             shadow_step_s=[round(t, 4) for t in times])
            if not self.commands.queue.empty():
                break
        self._set_standby_state("warm" if warmed else "cold", warmed)
        return engine

    # --- the training loop -------------------------------------------------------------------
    def train(self, role: Role, groups: CommGroups, engine: Engine, start_step: int,
              on_first_step=None) -> None:
        cfg = self.cfg
        runtime = WorkerRuntime(self.name, role, cfg.layout, groups, self.builder, self.stores,
                                self.commands, self.events)
        runtime.engine = engine
        engine.on_point = lambda point, step: faults.hit(
            cfg.runtime.faults, self.name, point, step, self.events,
            on_commerr=lambda: [g.abort() for g in groups.slots().values() if g.size > 1],
            store=self.store)
        runtime.on_point = engine.on_point
        metrics = JsonlWriter(os.path.join(self.run_dir, "metrics.jsonl")) \
            if role == reporter_role(cfg) else None
        tokens_per_step = cfg.train.global_batch * cfg.model.seq_len
        every = cfg.runtime.checkpoint_every
        checkpointer = AsyncCheckpointer(self.run_dir, role.name, cfg.layout.num_roles,
                                         self.stores.get()) if every else None
        if checkpointer is not None:
            checkpointer.on_write = lambda path: faults.hit(
                cfg.runtime.faults, self.name, "checkpoint", checkpointer.step, self.events,
                store=self.stores.get())
        record_key = None
        if cfg.runtime.record and cfg.runtime.standbys > 0 and start_step == 0:
            key = structure_key(cfg.layout, cfg.model.n_layers, role.pp)
            if representative_roles(cfg.layout, cfg.model.n_layers).get(key) == role:
                record_key = key
        is_reporter = role == reporter_role(cfg)
        vote = self._start_epoch(is_reporter)
        step = start_step
        while step < cfg.train.steps:
            if runtime.at_boundary(step) == LEAVE:
                self.events.emit("worker_left", step=step)
                return
            if step == cfg.runtime.restart_at_step and step != start_step:
                if checkpointer is not None:
                    checkpointer.wait()  # the checkpoint the restart loads
                self.events.emit("worker_stopped_for_restart", step=step)
                groups.shutdown()
                return
            try:
                if step == 0 and record_key is not None:
                    result = self._record_step(engine, groups, record_key, role, vote)
                else:
                    result = engine.train_step(step, commit=vote)
            except Exception as exc:  # noqa: BLE001 - sorted by is_step_failure
                if vote is None or not is_step_failure(exc, self.abort):
                    raise
                step, vote = self._survive(step, exc, role, groups, engine, runtime,
                                           is_reporter)
                continue
            if on_first_step is not None:
                on_first_step(result)
                on_first_step = None
            if checkpointer is not None and (step + 1) % every == 0:
                tensors, _ = local_state(engine.model, engine.optimizer)
                checkpointer.step = step  # the step just completed (fault points key on it)
                checkpointer.epoch = self.epoch
                checkpointer.save(step + 1, tensors)
            if metrics is not None:
                metrics.write({"step": step, "loss": result.loss,
                               "step_time_s": round(result.step_time_s, 6),
                               "tokens_per_s": round(tokens_per_step / result.step_time_s, 1),
                               "lr": result.lr, "grad_norm": result.grad_norm,
                               "worker": self.name})
            step += 1
        if checkpointer is not None:
            checkpointer.wait()
        if role.dp == 0:
            shard_dir = os.path.join(self.run_dir, "final", "shards")
            os.makedirs(shard_dir, exist_ok=True)
            tensors, dims = local_state(engine.model, engine.optimizer)
            save_atomic({"tensors": {k: v.cpu() for k, v in tensors.items()}, "dims": dims},
                        os.path.join(shard_dir, f"{role.name}.pt"))
        self.events.emit("worker_done", steps=cfg.train.steps)
        self.store.set(P.finished_key(self.name), "1")  # not a hang from here on
        groups.shutdown()

    # --- failures ------------------------------------------------------------------------------
    def _start_epoch(self, is_reporter: bool, watching: bool = False) -> CommitVote | None:
        """Arm this epoch's abort watcher (unless ``watching`` already) and commit vote (None
        when recovery is off)."""
        if not self.cfg.runtime.recover:
            return None
        if not watching:
            self.abort.clear()
            AbortWatcher(self.stores, self.abort, self.epoch)
        return CommitVote(self.stores, self.cfg.layout.num_roles, self.epoch,
                          self.name if is_reporter else None)

    def _report_failure(self, step: int, exc: BaseException, groups: CommGroups) -> None:
        """Tell the controller what this worker saw: the error, whether its own communicator
        failed, and each group's operation accounting (which groups are still consistent)."""
        own = [g.name for g in groups.slots().values()
               if g.error is not None and g.error.op == "abort"]
        accounting = {g.name: g.accounting() for g in groups.slots().values() if g.size > 1}
        self.store.set(P.failure_key(self.epoch, self.name), P.encode({
            "step": step, "error": f"{type(exc).__name__}: {exc}"[:400], "self": bool(own),
            "accounting": accounting}))
        self.events.emit("step_failed", step=step, epoch=self.epoch,
                         error=f"{type(exc).__name__}: {exc}"[:300])

    def _abortably(self, build):
        """Run ``build`` (a group rendezvous: a blocking call gloo cannot cancel) in a helper
        thread and wait for it, or raise ``StepAborted`` as soon as the epoch is aborted. An
        abandoned build times out on its own; its generation is never used again."""
        box: dict = {}
        done = threading.Event()

        def target():
            try:
                box["value"] = build()
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                box["error"] = exc
            done.set()

        threading.Thread(target=target, daemon=True, name="recovery-build").start()
        while not done.wait(0.001):
            if self.abort.is_set():
                raise StepAborted(f"group build abandoned: {self.abort.reason}")
        if "error" in box:
            raise box["error"]
        return box["value"]

    def _survive(self, step: int, exc: BaseException, role: Role, groups: CommGroups,
                 engine: Engine, runtime: WorkerRuntime, is_reporter: bool
                 ) -> tuple[int, CommitVote | None]:
        """A step failed here (a peer died, or the job aborted it). The optimizer did not
        run, so this worker still holds the state after the last committed step. Report what
        was seen, wait for the controller's plan, carry out this worker's part of it, and
        return the step to resume at."""
        t0 = time.perf_counter()
        self._report_failure(step, exc, groups)
        specs = self.cfg.layout.all_groups()
        while True:
            cmd = self.commands.next()
            if cmd["type"] != "recover":
                self.events.emit("command_dropped", command=cmd["type"], reason="recovering")
                continue
            faults.hit(self.cfg.runtime.faults, self.name, "recover", cmd["resume_step"],
                       self.events, store=self.store)
            runtime.active.clear()  # a migration in flight was settled by the controller
            # the recovery's own epoch: if the controller abandons this plan (a joiner or
            # another survivor failed meanwhile), every wait below is woken up
            self.abort.clear()
            AbortWatcher(self.stores, self.abort, cmd["epoch"])
            try:
                built = self._abortably(lambda: {
                    name: self.builder.build(specs[name], role, gen)
                    for name, gen in sorted(cmd["groups"].items())})
                runtime.retired.extend(groups.install(built))
                if cmd["rollback_step"] is not None:
                    apply_local_state(engine.model, engine.optimizer,
                                      load_local(self.run_dir, cmd["rollback_step"], role.name))
                sent = None
                if cmd["send_state"]:
                    s = cmd["send_state"]
                    channel = self._abortably(lambda: self.builder.build_ranked(
                        transfer_spec(s["transfer_group"], role), 0, s["transfer_generation"]))
                    sent = send_state(engine, channel, 1, cmd["resume_step"])
                    channel.shutdown()
            except Exception as err:  # noqa: BLE001 - sorted by is_step_failure
                if not is_step_failure(err, self.abort):
                    raise
                self.epoch = cmd["epoch"]
                self._report_failure(cmd["resume_step"], err, groups)
                continue
            break
        self.epoch = cmd["epoch"]
        vote = self._start_epoch(is_reporter, watching=True)
        self.store.add(P.recovery_key(cmd["recovery_id"], "recovered_count"), 1)
        self.events.emit("recovered", recovery_id=cmd["recovery_id"], epoch=self.epoch,
                         resume_step=cmd["resume_step"], rebuilt=sorted(built),
                         rollback_step=cmd["rollback_step"],
                         sent_bytes=None if sent is None else sent["bytes"],
                         duration_s=round(time.perf_counter() - t0, 4))
        return cmd["resume_step"], vote


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="trainmover.worker")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--store", required=True, type=StoreAddress.parse)
    p.add_argument("--standby", action="store_true")
    p.add_argument("--resume-step", type=int, default=0)
    p.add_argument("--generation", type=int, default=0)
    p.add_argument("--epoch", type=int, default=0)
    args = p.parse_args(argv)
    worker = Worker(args.run_dir, args.name, args.store)
    worker.epoch = args.epoch
    if args.standby:
        worker.run_standby()
    else:
        worker.run_active(args.resume_step, args.generation)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: after an aborted step, gloo threads of abandoned groups stay
    # blocked until their timeout and their destructors would hold the exit that long.
    # Everything this process must leave behind (events, metrics, shards) is already written.
    os._exit(code)
