"""The controller process of a job: runs the controller's decisions, sends commands, watches
progress and failures, and writes the job's summary (the final state itself is assembled by a
worker: the controller never touches tensors).

The decisions are the pure functions of ``core/decisions.py``; the drivers carry them out
(commands through the store) and watch for their completion: ``migrations.py``,
``recovery.py`` (on what ``health.py`` detects), ``baseline.py`` (the restart baseline) and
``supervision.py`` (process exits, standby readiness). They share a ``JobContext``
(``context.py``); this module is the thin loop that runs them, saves the snapshot and owns
the job's start and end. It is not on the training hot
path: workers train on their own groups and only look at commands between steps. The store
and the processes belong to the job's agent (``agent.py``), so this process may die at any
moment without stopping training, and a new one resumes from the store (``resume``):

- the controller's whole state is a snapshot, saved at the end of every supervision round
  in which it changed, in the store and in the run dir (``controller.snapshot``, signed
  and numbered: a resumed controller takes the newest genuine copy, so junk written over
  the store's does not stop it; ``snapshot_codec.py``);
- everything it tells the outside world (worker commands, decision keys, process starts) is
  queued in an *outbox* during the round and sent only after the snapshot that contains it
  was saved; keys are written with content fixed in advance (commands are numbered by the
  controller), so a resumed controller re-sends the outbox and nothing happens twice;
- only fencing (SIGKILL of a failed worker) and the compare-and-set that aborts a step are
  done at once: both are idempotent when a resumed controller repeats them.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import Future

from trainmover.control import collector
from trainmover.control.baseline import Restarts
from trainmover.control.context import (JobContext, Progress, count_text, restore_into,
                                        snapshot_of, worker_names)
from trainmover.control.errors import JobFailed, Superseded
from trainmover.control.health import Health
from trainmover.control.migrations import MigrationRequest, Migrations
from trainmover.control.processes import AgentClient
from trainmover.control.rebalance import Rebalancer
from trainmover.control.recovery import Recovery
from trainmover.control.replicas import Replicas
from trainmover.control.retention import Retention
from trainmover.control.saving import Saver
from trainmover.control import snapshot_codec
from trainmover.control.stopping import Stopping
from trainmover.control.stragglers import Stragglers
from trainmover.control.supervision import ProcessWatch
from trainmover.core import decisions as C
from trainmover.core import native_cache
from trainmover.core import protocol as P
from trainmover.core.auth import AuthStore, create_secret, load_secret
from trainmover.core.codec import Table
from trainmover.core.config import JobConfig, is_loopback
from trainmover.core.events import EventLog, read_jsonl
from trainmover.core import identity, jobfile, rundir, storeaddr
from trainmover.core.faults import Inject
from trainmover.core.files import latest_complete, read_digest, step_dir, usable_checkpoints
from trainmover.core.proc import pid_alive

MAX_HOLES_FILLED = 1000   # per host, by a resumed controller (see resume)
REGISTER_TRIES = 16       # compare-and-sets of the controller record (_register); each lost
                          # one means another controller wrote it meanwhile

__all__ = ["Coordinator", "JobFailed", "Superseded", "run_job", "worker_names"]


class Coordinator:
    """Runs one job. ``run()`` blocks until it ends; ``Job`` in api.py runs it in a thread.
    ``Coordinator.resume(run_dir)`` takes over a running job whose controller died."""

    def __init__(self, cfg: JobConfig, run_dir: str, quiet: bool = False,
                 injects: list[Inject] | None = None, timeout_s: float | None = None,
                 resume_from: int | None = None):
        """``resume_from``: continue a stopped job of this run dir from its step-K checkpoint
        (``resume_job`` checks and chooses it)."""
        self.cfg = cfg = JobConfig.from_dict(cfg.to_dict())   # the job's own copy
        self.run_dir = os.path.abspath(run_dir)
        self.quiet = quiet
        self.injects = sorted(injects or [], key=lambda i: i.step)
        self.timeout_s = timeout_s
        self.started = threading.Event()
        self._stop_requested = threading.Event()
        self.ctx = JobContext(cfg, self.run_dir, None,
                              Progress(os.path.join(self.run_dir, "metrics.jsonl"),
                                       cfg.train.steps, not quiet))
        self.retention = Retention(self.ctx)
        self.migrations = Migrations(self.ctx, self.retention)
        self.baseline = Restarts(self.ctx)
        self.health = Health(self.ctx)
        self.recovery = Recovery(self.ctx, self.health, self.migrations, self.baseline,
                                 self.retention)
        self.watch = ProcessWatch(self.ctx)
        self.stopping = Stopping(self.ctx)
        self.replicas = Replicas(self.ctx)
        self.stragglers = Stragglers(self.ctx, self.migrations, self.health, self._new_client)
        self.rebalancer = Rebalancer(self.ctx, self.migrations)
        self.resume_from = resume_from
        self._data_kept = False
        self.saver = Saver(self.ctx, self.run_dir, self._snapshot, self.retention,
                           lambda: self.stragglers.latest)
        self._agent_proc: subprocess.Popen | None = None
        self._incarnation_checked_at = 0.0
        self._requests_read_at = 0.0
        self.node = 0                 # the host this controller runs on
        self._beat_at = float("-inf")
        self._beats = 0
        self.resumed = False
        self._secret: bytes | None = None

    # what callers watching a running job read (benchmarks, the Python API)
    @property
    def membership(self) -> C.Membership:
        return self.ctx.membership

    @property
    def progress(self) -> Progress:
        return self.ctx.progress

    @property
    def procs(self) -> AgentClient:
        return self.ctx.procs

    @property
    def events(self) -> EventLog:
        return self.ctx.events

    @property
    def restarts(self) -> list[dict]:
        return self.baseline.restarts

    @property
    def stop_asked(self) -> bool:
        return self.stopping.asked

    def request_stop(self, reason: str = "api") -> None:
        """Thread-safe (a signal handler may call it): stop gracefully, a checkpoint taken
        a few steps ahead; ``run()`` then returns a summary with ``stopped``."""
        self.stopping.request(reason)

    def request_migration(self, workers: list[str], targets: list[str] | None = None,
                          naive: bool = False, source: str = "api") -> Future:
        """Thread-safe; the future gets the migration's final result."""
        return self.migrations.request(workers, targets, naive, source)

    # --- set-up ----------------------------------------------------------------------------
    def _build_native(self) -> None:
        """The script's torch process groups need the forwarding backend (comm/native):
        built here, once per machine, before any process starts, by a child interpreter (the
        controller imports neither torch nor the communication layer)."""
        if native_cache.looks_built():
            return   # the child would import torch (seconds) only to find it built
        cmd = [sys.executable, "-m", "trainmover.comm.native"]
        why = None
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True,
                                  timeout=self.cfg.comm.build_timeout_s)
            if proc.returncode != 0:
                why = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-12:]) or \
                    f"exit status {proc.returncode}"
        except subprocess.TimeoutExpired:
            why = f"the build took over {self.cfg.comm.build_timeout_s:.0f} s " \
                  f"(comm.build_timeout_s)"
        if why is not None:
            raise ValueError(f"comm.torch_groups={self.cfg.comm.torch_groups!r}: the script's "
                             f"torch process groups need trainmover's forwarding backend, "
                             f"which could not be built: {why} (comm.torch_groups='off' runs "
                             f"without them)")

    def _prepare(self) -> None:
        ctx = self.ctx
        if os.path.lexists(self.run_dir):
            rundir.check_dir(self.run_dir)   # planted by someone else, or a symlink: refused
        if os.path.exists(os.path.join(self.run_dir, "job.json")) and self.resume_from is None:
            raise ValueError(f"run dir {self.run_dir!r} already holds a job; choose a new "
                             f"--run-dir, or continue it with --resume")
        self._place_on_gpus()
        if self.cfg.has_torch_groups():
            self._build_native()
        # the run dir holds the job's secret, logs and checkpoints: its owner's alone
        if self.resume_from is None:
            rundir.create(self.run_dir)
        else:
            rundir.check_dir(self.run_dir)
        os.makedirs(os.path.join(self.run_dir, "logs"), exist_ok=True)
        self._secret = create_secret(self.run_dir) if self.resume_from is None else \
            load_secret(self.run_dir)
        jobfile.write_job(self.run_dir, self.cfg, self._secret)
        self._run_key = jobfile.start_run(self.run_dir, self._secret)
        if self.resume_from is None:
            identity.write_identity(self.run_dir, identity.of_job(self.cfg.to_dict(),
                                                                  self.cfg.process.command),
                                    self._secret)
        ctx.events = EventLog(os.path.join(self.run_dir, "events.jsonl"), worker="coordinator")
        host = self.cfg.process.store_host
        listener = None
        if self.cfg.process.etcd:
            ctx.store_addr = self.cfg.process.etcd        # a cluster of the user's: no server
        else:
            # the store's socket is opened here and inherited by the agent, which starts the
            # first processes before it even imports torch: no start-up latency is added
            try:
                listener = socket.create_server((host, self.cfg.process.store_port),
                                                backlog=1024)
            except OSError as exc:
                raise ValueError(f"cannot listen on {host}:{self.cfg.process.store_port} "
                                 f"(process.store_host, process.store_port): {exc}") from exc
            ctx.store_addr = f"{host}:{listener.getsockname()[1]}"
        if listener is not None and not is_loopback(host):
            ctx.progress.say(f"the job's store listens on {ctx.store_addr} (--allow-remote): "
                             f"its values are signed, but anyone on that network can flood or "
                             f"delete its keys and reach the workers' gloo/NCCL ports")
        ctx.procs.nnodes = self.cfg.hosts.nnodes
        workers = worker_names(self.cfg.layout.num_roles)
        standbys = worker_names(self.cfg.standby.count, "s")
        ctx.membership = C.Membership.initial(self.cfg.layout, workers, standbys)
        restart = {} if self.resume_from is None else {"resume_step": self.resume_from}
        ctx.committed = (self.resume_from or 0) - 1
        initial = [ctx.spawn_request(n, standby=False, **restart) for n in workers] + \
                  [ctx.spawn_request(n, standby=True) for n in standbys]
        # host 0's agent starts its processes from a file, before it serves the store; the
        # other hosts' agents find theirs queued in the store when they connect
        init_path = os.path.join(self.run_dir, "agent_initial.jsonl")
        with open(init_path, "w") as f:
            f.writelines(P.encode_agent_request(r) + "\n" for node, r in initial if node == 0)
        ctx.outbox.extend(("agent", node, r) for node, r in initial if node != 0)
        # the agent reads its settings from job.json, written above
        serve = [] if listener is None else ["--listen-fd", str(listener.fileno())]
        with open(os.path.join(self.run_dir, "logs", "agent.log"), "ab") as log:
            self._agent_proc = subprocess.Popen(
                [sys.executable, "-m", "trainmover.agent", "--run-dir", self.run_dir,
                 "--store", ctx.store_addr, *serve, "--address", host, "--initial", init_path,
                 "--controller-pid", str(os.getpid())],
                pass_fds=[] if listener is None else [listener.fileno()], stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True)  # outlives this process, and the terminal's Ctrl-C
        if listener is not None:
            listener.close()
        # complete when it appears (agents read it)
        jobfile.write_control(self.run_dir, {"store": ctx.store_addr,
                                             "agent_pid": self._agent_proc.pid}, self._secret)
        self._connect()
        if self.resume_from is not None:
            ctx.store.set(P.RESUMED_KEY, str(self.resume_from))
            known = identity.read_identity(self.run_dir, self._secret)
            if known.data_sha256:
                ctx.store.set(identity.DATA_KEY, known.data_sha256)   # the first run's data
        for name, role in ctx.membership.workers.items():
            ctx.put(P.membership_key(name), role.name)

    def _place_on_gpus(self) -> None:
        """Device "cuda": each process gets a GPU of this host (``LOCAL_RANK``); the backend
        is NCCL when there are enough GPUs for every process, else gloo through host memory."""
        if self.cfg.process.device != "cuda":
            return
        import torch

        gpus = torch.cuda.device_count()
        if gpus == 0:
            raise ValueError("process.device is 'cuda' but this host has no CUDA device")
        self.ctx.gpus = gpus
        names = worker_names(self.cfg.layout.num_roles) + worker_names(self.cfg.standby.count,
                                                                         "s")
        per_host = [self.ctx.place(n) for n in names]
        processes = max(per_host.count(node) for node in set(per_host))
        if self.cfg.comm.backend == "auto":
            self.cfg.comm.backend = "nccl" if gpus >= processes else "gloo"
            if gpus < processes:
                self.ctx.progress.say(f"{processes} processes on a host of {gpus} GPU(s): they "
                                      f"share GPUs and communicate over gloo through host "
                                      f"memory")
        elif self.cfg.comm.backend == "nccl" and gpus < processes:
            raise ValueError(f"comm.backend 'nccl' needs a GPU per process: {processes} "
                             f"processes (workers and standbys) on a host, {gpus} GPU(s)")

    def _connect(self, store=None) -> None:
        """Connect (or adopt ``store``) and register as the job's controller."""
        ctx = self.ctx

        def rejected(key, exc):
            ctx.events.emit("message_rejected", key=key, error=str(exc))

        ctx.store = store or AuthStore(storeaddr.connect(
            ctx.store_addr, self._run_key, self.cfg.comm.store_timeout_s), self._run_key,
            on_reject=rejected)
        if getattr(ctx.store, "on_reject", rejected) is None:
            ctx.store.on_reject = rejected    # the resumed controller's probe reports too
        ctx.procs.store, ctx.procs.events = ctx.store, ctx.events
        ctx.secret = self._run_key          # the snapshot holders' frames are the run's
        self.incarnation = ctx.store.add(P.CONTROLLER_INCARNATION_KEY, 1)
        self._register()
        self._beat()

    def _new_client(self) -> AuthStore:
        """A store client of the controller's besides ``ctx.store`` (for a thread)."""
        return AuthStore(storeaddr.connect(self.ctx.store_addr, self._run_key,
                                           self.cfg.comm.store_timeout_s), self._run_key,
                         on_reject=self.ctx.store.on_reject)

    def _register(self) -> None:
        """Make this controller's record the job's, unless a newer incarnation's is there
        (then step down). Two controllers starting together (the controller's own agent
        restarts it while a successor host takes over) once both wrote the record, the
        older last, and each then read an incarnation not above its own: both ran."""
        mine = P.write_message(P.ControllerInfo(os.getpid(), self.incarnation, self.node))
        expected: bytes | str = ""
        for _ in range(REGISTER_TRIES):
            got = self.ctx.store.compare_set(P.CONTROLLER_KEY, expected, mine)
            if got == mine.encode():
                return
            try:
                current = P.read_message(P.ControllerInfo, got)
            except P.MessageError:
                current = None       # not a record: replaced like an older one
            if current is not None and current.incarnation > self.incarnation:
                raise Superseded(f"controller incarnation {current.incarnation} (PID "
                                 f"{current.pid}) took over from {self.incarnation}")
            expected = got
        raise RuntimeError(f"the controller record kept changing ({REGISTER_TRIES} tries)")

    def _beat(self) -> None:
        """With the store on etcd: the beat the other hosts' agents watch (one key, written
        every ``controller.beat_interval_s``: O(1) store load at any size)."""
        if not self.cfg.process.etcd:
            return
        now = time.monotonic()
        if now - self._beat_at < self.cfg.controller.beat_interval_s:
            return
        self._beat_at = now
        self._beats += 1
        self.ctx.store.set(P.CONTROLLER_BEAT_KEY, f"{self.incarnation}.{self._beats}")

    # --- the snapshot and the outbox --------------------------------------------------------
    def _snapshot(self) -> dict:
        return {"ctx": snapshot_of(self.ctx), "migrations": snapshot_of(self.migrations),
                "recovery": snapshot_of(self.recovery), "baseline": snapshot_of(self.baseline),
                "watch": snapshot_of(self.watch), "retention": snapshot_of(self.retention),
                "stopping": snapshot_of(self.stopping), "replicas": snapshot_of(self.replicas),
                "stragglers": snapshot_of(self.stragglers),
                "rebalancer": snapshot_of(self.rebalancer),
                "injects": self.injects}

    def _flush(self, force: bool = False) -> None:
        """The round's end: the snapshot saved, then the outbox sent (``control/saving.py``)."""
        self.saver.flush(force, busy=bool(self.ctx.outbox) or self.migrations.active is not None
                         or self.recovery.active is not None or bool(self.migrations.pending))

    @property
    def _run_key(self) -> bytes | None:
        return self.saver.run_key

    @_run_key.setter
    def _run_key(self, key: bytes | None) -> None:
        self.saver.run_key = key

    @classmethod
    def resume(cls, run_dir: str, quiet: bool = False, force: bool = False, node: int = 0,
               takeover: bool = False) -> "Coordinator":
        """A controller for a job whose controller died: the same view, rebuilt from the
        store (its snapshot, the agent's process records) and the run dir (job spec, metrics,
        checkpoints). ``node``: the host it runs on; ``takeover``: started by that host's
        agent after the controller's host fell silent (the store on etcd), where no PID of
        host 0 means anything."""
        run_dir = os.path.abspath(run_dir)
        for name in ("job.json", "control.json"):
            if not os.path.exists(os.path.join(run_dir, name)):
                raise ValueError(f"{run_dir!r} holds no running job (no {name})")
        cfg = jobfile.read_job(run_dir)
        control = jobfile.read_control(run_dir)
        if takeover and not storeaddr.is_etcd(control["store"]):
            raise ValueError("a controller takes over on another host only with the store on "
                             "etcd (process.etcd): the built-in store lives on host 0")
        # control.json names host 0's agent: its PID means something on host 0 only (a
        # controller restarted by the agent of the host that took over runs elsewhere)
        if node == 0 and not takeover and not pid_alive(control["agent_pid"]):
            raise ValueError(f"the job in {run_dir!r} has ended (its agent, PID "
                             f"{control['agent_pid']}, is gone)")
        self = cls(cfg, run_dir, quiet)
        self.node = node
        ctx = self.ctx
        ctx.store_addr = control["store"]
        self._secret = load_secret(run_dir)
        self._run_key = jobfile.run_key(run_dir, self._secret)    # the same run goes on
        probe = AuthStore(storeaddr.connect(ctx.store_addr, self._run_key,
                                            cfg.comm.store_timeout_s), self._run_key)
        raw = probe.valid(P.CONTROLLER_KEY)     # a forged record: no controller known
        try:
            current = P.read_message(P.ControllerInfo, raw) if raw is not None else None
        except P.MessageError:
            current = None
        if current is not None and current.node == node and not takeover:
            if pid_alive(current.pid) and current.pid != os.getpid() and not force:
                raise ValueError(f"the job's controller (PID {current.pid}) is alive; "
                                 f"pass --force to take over anyway")
        # the newest genuine copy, the store's or the run dir's: junk at the store's key
        # (anyone can write it) or an older genuine value put back there is passed over
        parts: set[tuple[str, str]] = set()
        try:
            self.saver.saves, state, passed_over = snapshot_codec.read_newest(
                run_dir, probe, self._run_key, parts)
        except ValueError as exc:
            raise ValueError(f"the job in {run_dir!r} cannot be resumed: {exc}") from exc
        self.saver.adopt(parts)
        restore_into(ctx, state["ctx"])
        ctx.cmd_next, ctx.hosts = Table(ctx.cmd_next), Table(ctx.hosts)   # an older one's dicts
        restore_into(self.migrations, state["migrations"])
        restore_into(self.recovery, state["recovery"])
        restore_into(self.baseline, state["baseline"])
        restore_into(self.watch, state["watch"])
        restore_into(self.retention, state["retention"])
        restore_into(self.stopping, state["stopping"])
        restore_into(self.replicas, state["replicas"])
        for name, driver in (("stragglers", self.stragglers), ("rebalancer", self.rebalancer)):
            if name in state:     # absent from a snapshot of an older version
                restore_into(driver, state[name])
        self.injects = state["injects"]
        ctx.events = EventLog(os.path.join(run_dir, "events.jsonl"), worker="coordinator")
        if passed_over:
            ctx.events.emit("snapshot_passed_over", save=self.saver.saves, copies=passed_over,
                            level="warning")
        self._connect(probe)   # one client: the one that read the snapshot
        self.resumed = True
        ctx.disrupted()   # heartbeats and step times are judged afresh
        ctx.progress.enabled = False
        ctx.progress.poll()          # catch up silently, then report new steps as usual
        ctx.progress.enabled = not quiet
        # Steps committed after the snapshot was saved: the dead controller may have deleted
        # their decision keys already (retention), which would stop the walk over decisions
        # at the snapshot's count, and a later abort would then land on a committed step.
        # Every record of the current epoch in metrics.jsonl is a committed step of it.
        recorded = [r["step"] for r in ctx.progress.records if r.get("epoch") == ctx.epoch]
        if recorded and max(recorded) > ctx.committed:
            ctx.events.emit("committed_from_metrics", snapshot=ctx.committed,
                            recorded=max(recorded))
            ctx.committed = max(recorded)
        # a request number taken by a controller that died before writing it would stall
        # the agent's queue: fill such holes with no-ops
        for node in range(ctx.procs.nnodes):
            count = ctx.store.add(P.agent_key(node, "req/count"), 0)
            done = ctx.store.add(P.agent_key(node, "req/done"), 0)
            # bounded: the counter is unsigned, and a forged bump must not make us write
            # a billion no-ops (the agent's queue reader skips holes by itself)
            for i in range(done + 1, min(count, done + MAX_HOLES_FILLED) + 1):
                if not ctx.store.check([P.agent_request_key(node, i)]):
                    ctx.store.set(P.agent_request_key(node, i),
                                  P.encode_agent_request(P.AgentNoop()))
        return self

    # --- the run -----------------------------------------------------------------------------
    def run(self, own_process: bool = False) -> dict:
        """Supervise the job to its end. ``own_process``: this process is the job's
        controller and nothing else (the CLI, a benchmark): its start-up state is then kept
        out of the garbage collector's walks (``collector.settle``)."""
        cfg, ctx = self.cfg, self.ctx
        if not self.resumed:
            self._prepare()
            ctx.events.emit("job_started", layout=cfg.layout.as_dict(),
                            workers=len(ctx.membership.workers),
                            standbys=len(ctx.membership.standbys), store=ctx.store_addr,
                            agent_pid=self._agent_proc.pid, resumed_from=self.resume_from)
            ctx.progress.say(f"job {cfg.name!r} {cfg.layout} on "
                             f"{len(ctx.membership.workers)} workers + "
                             f"{len(ctx.membership.standbys)} standby, "
                             + (f"{count_text(cfg.model.num_params())} parameters, "
                                if cfg.process.builtin else "") + f"run dir "
                             f"{self.run_dir}" + ("" if self.resume_from is None else
                                                  f", resumed at step {self.resume_from}"))
            if not cfg.checkpoint.every and not cfg.layout.has_replicas:
                why = ("checkpoints are off (checkpoint.every=0) and no role has a "
                       "data-parallel replica: " + (
                           "a failed worker is recovered only from the in-memory snapshots "
                           "(lost with their host) and the job cannot be resumed"
                           if cfg.takes_snapshots() else
                           "a failed worker cannot be recovered and the job cannot be "
                           "resumed"))
                ctx.events.emit("no_recovery_source", reason=why, level="warning")
                ctx.progress.say(f"warning: {why}")
        else:
            ctx.events.emit("controller_resumed", incarnation=self.incarnation,
                            pid=os.getpid(), last_step=ctx.progress.last_step,
                            active_migration=None if self.migrations.active is None
                            else self.migrations.active.plan.migration_id,
                            active_recovery=None if self.recovery.active is None
                            else self.recovery.active.recovery_id)
            ctx.progress.say(f"controller resumed (incarnation {self.incarnation}) at step "
                             f"{ctx.progress.last_step + 1} of job {cfg.name!r}")
        t0 = time.perf_counter()
        try:
            self._flush(force=True)   # a resumed controller re-sends what its predecessor left
            if own_process:
                collector.settle()
            self.started.set()
            while not self._stop_requested.is_set() and not self._poll():
                self._flush()
                self._controller_faults()
                if self.timeout_s is not None and time.perf_counter() - t0 > self.timeout_s:
                    raise JobFailed(f"job exceeded its timeout of {self.timeout_s} s")
                time.sleep(cfg.controller.poll_s)
            self._flush(force=True)
            # read while the store is up: stopping the processes takes it down
            stop_step = self.stopping.stop_step() if self.stopping.requested else None
            if not self._stop_requested.is_set() and cfg.layout.has_replicas and \
                    read_digest(self.run_dir) is not None:
                ctx.progress.poll()
                self.replicas.compare(ctx.progress.last_step + 1)   # the final states
            # a migration in the job's last steps is accounted from the stayers' step ends,
            # read from the store: now, not after the processes (and the store) stopped
            ctx.progress.poll()
            self._finish_downtimes(final=True)
        except Superseded:
            self.started.set()
            raise
        except BaseException as exc:
            self._failed(exc)
            try:
                self.migrations.fail_all(exc)
                self._flush(force=True)
            except Exception:  # noqa: BLE001 - the store may be what failed; stop anyway
                pass
            if ctx.store is not None:
                self._stop_all()
            elif self._agent_proc is not None:
                self._agent_proc.kill()   # its workers die with it (PR_SET_PDEATHSIG)
            raise
        finally:
            self.started.set()
            ctx.progress.close()
        self._stop_all()  # standbys still waiting
        wall = time.time() - ctx.t_started
        if self._stop_requested.is_set():
            # stopped on request (benchmarks): no final state, but every event's accounting
            ctx.events.emit("job_stopped", wall_s=round(wall, 3),
                            last_step=ctx.progress.last_step)
            return {"stopped": True, "steps": ctx.progress.last_step + 1,
                    "wall_s": round(wall, 3), "migrations": self.migrations.finished,
                    "restarts": self.baseline.report(), "recoveries": self.recovery.done}
        if self.stopping.requested and read_digest(self.run_dir) is None:
            return self._stopped(wall, stop_step)
        try:
            summary = self._finish(wall)
        except JobFailed as exc:
            self._failed(exc)
            raise
        ctx.events.emit("job_done", wall_s=round(wall, 3),
                        weights_sha256=summary["weights_sha256"])
        return summary

    def stop(self) -> None:
        """Stop every process at once and end ``run()`` without a final state (thread-safe).
        Committed steps and their checkpoints are left as they are."""
        self._stop_requested.set()

    def _check_incarnation(self) -> None:
        now = time.monotonic()
        if now - self._incarnation_checked_at < self.cfg.controller.incarnation_check_s:
            return
        self._incarnation_checked_at = now
        # The signed record of the current controller decides, not the counter: anyone who
        # reaches the store can bump a counter (four bumps once made the controller step
        # down), only a controller of this job can write the record. A forged record reads
        # as none.
        current = self.ctx.read(P.ControllerInfo, P.CONTROLLER_KEY)
        if current is not None and current.incarnation > self.incarnation and \
                current.pid != os.getpid():
            raise Superseded(f"controller incarnation {current.incarnation} (PID "
                             f"{current.pid}) took over from {self.incarnation}")

    def _poll(self) -> bool:
        """One round of supervision; True when the job has finished."""
        ctx = self.ctx
        self._check_incarnation()
        self._beat()
        for name, pid in ctx.procs.refresh():
            self.retention.process_exited(name, pid)
        standbys = ctx.membership.standbys
        ctx.progress.standbys = (sum(1 for st in standbys.values() if st is C.StandbyState.WARM),
                                 len(standbys))
        ctx.progress.poll()
        self.watch.check_exits(self.recovery.failed_workers)
        self.watch.update_standbys()
        self.watch.fence_hung_standbys(self.health.hung_standbys())
        if not self.stopping.requested:
            self.watch.replenish()
        if self.cfg.health.recover:
            self.recovery.poll()
        now = time.monotonic()
        from_store = now - self._requests_read_at >= self.cfg.controller.request_poll_s
        if from_store:
            self._requests_read_at = now
        self.migrations.collect(from_store)
        self.stopping.collect(from_store)
        if from_store:
            self._keep_data_identity()
        self._fire_injects()
        if self.recovery.active is None and self._job_finished():
            return True
        if self.recovery.active is None:
            self.stragglers.poll()
            if not self.stopping.requested:
                self.rebalancer.poll()
            self.migrations.poll(start_new=not self.stopping.requested)
        self.stopping.poll(busy=self.migrations.active is not None or
                           self.recovery.active is not None)
        self._finish_downtimes()
        self.retention.poll()
        self.replicas.poll()
        return False

    def _keep_data_identity(self) -> None:
        """Once a process declared the job's data, record its digest in the run dir: a
        resumed job checks its data against it."""
        if self._data_kept:
            return
        store = self.ctx.store
        if not store.check([identity.DATA_KEY]):
            return
        digest = store.valid(identity.DATA_KEY)
        if digest is None:
            return
        digest = digest.decode()
        known = identity.read_identity(self.run_dir, self._secret)
        if known.data_sha256 != digest:
            known.data_sha256 = digest
            identity.write_identity(self.run_dir, known, self._secret)
        self._data_kept = True

    def _job_finished(self) -> bool:
        """Every role holder exited cleanly (checked before migrations advance: a joiner
        whose leaver finished the job first loses its channel, which is not a failure)."""
        ctx = self.ctx
        failed = self.recovery.failed_workers   # failed after the last step: stood in for
        if not all(ctx.procs.exit_code(w) == 0 for w in ctx.membership.workers
                   if w not in failed):
            return False
        # a leaver that reached its switch exited at it: its joiner holds the role now, and
        # the job is not done until the joiner is (it may still be in the last step)
        if not all(ctx.procs.exit_code(j) == 0 for j in self.migrations.joiners_past_switch()):
            return False
        if self.baseline.due():
            self.baseline.restart()
            return False
        self.migrations.job_finished()
        return True

    def _finish_downtimes(self, final: bool = False) -> None:
        self.recovery.finish_downtimes(final)
        self.migrations.finish_downtimes(final)

    # --- injects -----------------------------------------------------------------------------
    def _controller_faults(self) -> None:
        """A scheduled crash of this controller process at a point reached in this round
        (tests, chaos): it is taken off the schedule and the snapshot saved first, so the
        controller that resumes does not crash again, then SIGKILL, no clean-up."""
        ctx = self.ctx
        points, ctx.points_reached = ["boundary", *ctx.points_reached], []
        for point in points:
            due = [i for i in self.injects if i.target == "controller" and
                   (i.arg or "boundary") == point and i.step <= ctx.progress.last_step + 1]
            if not due:
                continue
            self.injects = [i for i in self.injects if i is not due[0]]
            ctx.events.emit("fault_injected", kind="crash", point=point, target="controller",
                            step=ctx.progress.last_step + 1, pid=os.getpid())
            self._flush(force=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def _fire_injects(self) -> None:
        ctx = self.ctx
        due = [i for i in self.injects if i.step <= ctx.progress.last_step + 1
               and i.target != "controller"]
        if not due:
            return
        self.injects = [i for i in self.injects if i not in due]
        by_step: dict[int, list[Inject]] = {}
        for inj in due:
            by_step.setdefault(inj.step, []).append(inj)
        for step, group in sorted(by_step.items()):
            migrations = [i for i in group if i.kind == "migrate"]
            if migrations:
                targets = [i.arg for i in migrations]
                ctx.events.emit("inject", kinds=[str(i) for i in migrations],
                                at_step=ctx.progress.last_step + 1)
                self.migrations.submit(MigrationRequest(
                    [i.target for i in migrations],
                    targets if all(targets) else None, "inject"))

    # --- stopping and the end ------------------------------------------------------------------
    def _stop_all(self) -> None:
        """Every process and the agent stop (the job is over or failed)."""
        ctl = self.cfg.controller
        self.ctx.procs.shutdown(ctl.stop_grace_s, ctl.agent_exit_timeout_s)
        if self._agent_proc is not None:
            try:
                self._agent_proc.wait(timeout=ctl.agent_exit_timeout_s)
            except subprocess.TimeoutExpired:
                self._agent_proc.kill()
                self._agent_proc.wait()

    def _stopped(self, wall_s: float, step: int | None) -> dict:
        """The end of a graceful stop: every worker wrote the checkpoint taken before the
        agreed step and exited. The summary says where ``--resume`` continues."""
        ctx = self.ctx
        newest = latest_complete(self.run_dir, [r.name for r in self.cfg.layout.roles()])
        if step is None or newest != step:
            raise JobFailed(f"the graceful stop did not complete the step-{step} checkpoint "
                            f"(the newest complete one is step {newest}); committed progress "
                            f"and checkpoints are intact")
        summary = {
            "name": self.cfg.name, "stopped": True, "reason": self.stopping.reason,
            "resume_step": step, "checkpoint": step_dir(self.run_dir, step),
            "steps": step, "wall_s": round(wall_s, 3),
            "layout": self.cfg.layout.as_dict(),
            "membership": {w: r.name for w, r in sorted(ctx.membership.workers.items())},
            "migrations": self.migrations.finished, "restarts": self.baseline.report(),
            "recoveries": self.recovery.done,
        }
        write_summary(self.run_dir, summary)
        ctx.events.emit("job_stopped", wall_s=round(wall_s, 3), resume_step=step,
                        reason=self.stopping.reason)
        ctx.progress.say(f"stopped at step {step} ({self.stopping.reason}); continue with "
                         f"`trainmover run --resume {self.run_dir}`")
        return summary

    def _failed(self, exc: BaseException) -> None:
        """The job's end as an event (``trainmover status`` of the ended job reads it)."""
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            return
        try:
            self.ctx.events.emit("job_failed", error=f"{type(exc).__name__}: {exc}"[:4000],
                                 level="error")
        except Exception:  # noqa: BLE001 - the failure itself is what the caller reports
            pass

    def _finish(self, wall_s: float) -> dict:
        cfg = self.cfg
        final = read_digest(self.run_dir)
        if final is None:
            raise JobFailed(f"the job's final state was not assembled ({self.run_dir}/final/"
                            f"digest.json is missing): see the log of the worker holding "
                            f"role dp0.pp0.tp0")
        digest, ckpt_dir = final["weights_sha256"], final["checkpoint"]
        records = read_jsonl(os.path.join(self.run_dir, "metrics.jsonl"))
        # a rollback commits some steps twice: the later record is the one that counts
        metrics = list({m["step"]: m for m in records}.values())
        steady = [m["step_time_s"] for m in metrics[1:]]
        summary = {
            "name": cfg.name,
            "steps": len(metrics),
            "steps_recomputed": len(records) - len(metrics),
            "final_loss": metrics[-1]["loss"] if metrics else None,
            "layout": cfg.layout.as_dict(),
            "workers": cfg.layout.num_roles,
            "standbys": cfg.standby.count,
            "membership": {w: r.name for w, r in sorted(self.ctx.membership.workers.items())},
            "weights_sha256": digest,
            # every data-parallel replica ended (and, with health.verify_every, was at each
            # check) in the same state; None: the job has no replicas
            "replicas_agree": self.replicas.agree(),
            "replica_checks": self.replicas.checked,
            "checkpoint": ckpt_dir,
            "wall_s": round(wall_s, 3),
            "mean_step_time_s": statistics.fmean(steady) if steady else None,
            "migrations": self.migrations.finished,
            "restarts": self.baseline.report(),
            "recoveries": self.recovery.done, "stragglers": self.stragglers.found,
        }
        write_summary(self.run_dir, summary)
        return summary


def run_job(cfg: JobConfig, run_dir: str, quiet: bool = False, timeout_s: float | None = None,
            injects: list[Inject] | None = None) -> dict:
    """Run a job to completion and return its summary (also written to summary.json).
    ``cfg`` must already be validated: nothing here should fail on user input."""
    return Coordinator(cfg, run_dir, quiet, injects, timeout_s).run()


def resumable(run_dir: str) -> tuple[JobConfig, int]:
    """The job of a stopped (or failed, or killed) run dir and the step it continues from:
    the newest complete checkpoint whose files look intact (each file's sha256 is checked
    again as it loads; a mismatch is recovered from like a failure). Raises ValueError,
    naming what is wrong, before anything starts."""
    run_dir = os.path.abspath(run_dir)
    path = os.path.join(run_dir, "job.json")
    if not os.path.exists(path):
        raise ValueError(f"--resume {run_dir!r}: no job there (no job.json)")
    if read_digest(run_dir) is not None:
        raise ValueError(f"--resume {run_dir!r}: the job already finished (final/digest.json)")
    cfg = jobfile.read_job(run_dir)     # the run dir checked, job.json's MAC too
    secret = load_secret(run_dir)
    if os.path.exists(os.path.join(run_dir, jobfile.CONTROL_FILE)):
        agent = jobfile.read_control(run_dir, secret).get("agent_pid")
        if isinstance(agent, int) and pid_alive(agent):
            raise ValueError(f"--resume {run_dir!r}: the job is still running (its agent, PID "
                             f"{agent}); stop it first (`trainmover stop --run-dir {run_dir}`)")
    identity.compare(identity.read_identity(run_dir, secret),
                     identity.of_job(cfg.to_dict(), cfg.process.command), f"--resume {run_dir!r}")
    usable, skipped = usable_checkpoints(run_dir, [r.name for r in cfg.layout.roles()])
    if not usable:
        why = "; ".join(f"step {k}: {r}" for k, r in sorted(skipped.items()))
        raise ValueError(f"--resume {run_dir!r}: no complete checkpoint to continue from"
                         + (f" (skipped: {why})" if why else ""))
    return cfg, usable[-1]


def write_summary(run_dir: str, summary: dict) -> None:
    """``summary.json``, whole or not at all: `trainmover stop`, the benchmarks and users'
    scripts wait for the file to appear and read it at once (a plain write let them read it
    empty: a JSONDecodeError in a test that polled for it)."""
    rundir.write_atomic(os.path.join(run_dir, "summary.json"),
                        json.dumps(summary, indent=2).encode())
