"""The controller process of a job: runs the controller's decisions, sends commands, watches
progress and failures, and writes the job's summary (the final state itself is assembled by a
worker: the controller never touches tensors).

The decisions are the pure functions of ``core/decisions.py``; this module carries them out
(commands through the store) and watches for their completion. It is not on the training hot
path: workers train on their own groups and only look at commands between steps. The store
and the processes belong to the job's agent (``agent.py``), so this process may die at any
moment without stopping training, and a new one resumes from the store (``resume``):

- the controller's whole state is a snapshot in the store, saved at the end of every
  supervision round in which it changed;
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
import queue
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta

from trainmover.core import decisions as C
from trainmover.core import protocol as P
from trainmover.control.processes import AgentClient, ProcView
from trainmover.core.proc import pid_alive
from trainmover.core.config import JobConfig
from trainmover.core.events import EventLog, read_jsonl
from trainmover.core.faults import Inject
from trainmover.control.errors import JobFailed, Superseded  # noqa: F401 (re-exported)
from trainmover.control.recovery import ActiveRecovery, Failure, Recovery
from trainmover.core.codec import Codec
from trainmover.core.topology import Layout, Role
from trainmover.core.accounting import downtime_from_metrics
from trainmover.core.files import read_digest




def worker_names(n: int, prefix: str = "w") -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


@dataclass
class Progress:
    """Tails metrics.jsonl; prints one line per committed step."""

    path: str
    total_steps: int
    enabled: bool = True
    records: list = field(default_factory=list)
    _offset: int = 0
    _buf: str = ""

    @property
    def last_step(self) -> int:
        """The newest committed step (after a rollback, steps are committed again)."""
        return self.records[-1]["step"] if self.records else -1

    def poll(self) -> None:
        if not os.path.exists(self.path):
            return
        with open(self.path) as f:
            f.seek(self._offset)
            chunk = f.read()
            self._offset = f.tell()
        self._buf += chunk
        *lines, self._buf = self._buf.split("\n")
        for line in lines:
            if not line:
                continue
            rec = json.loads(line)
            self.records.append(rec)
            if self.enabled:
                loss = rec.get("loss")
                total = f"/{self.total_steps}" if self.total_steps else ""
                print(f"step {rec['step'] + 1:>5}{total}  "
                      + (f"loss {loss:.4f}  " if isinstance(loss, (int, float)) else "")
                      + f"{rec['step_time_s'] * 1000:8.1f} ms/step  "
                      + (f"{rec['tokens_per_s']:>10.0f} tok/s  " if "tokens_per_s" in rec else "")
                      + f"[{rec['worker']}]", flush=True)

    def say(self, text: str) -> None:
        if self.enabled:
            print(f"trainmover: {text}", flush=True)


@dataclass
class MigrationRequest:
    workers: list[str]
    targets: list[str] | None = None
    source: str = "api"
    store_index: int | None = None          # set for requests from `trainmover migrate`
    future: Future = field(default_factory=Future)
    naive: bool = False
    # an API caller's future lives in the process that died; a resumed controller still
    # carries the request out (and answers store requests)
    __snapshot_exclude__ = ("future",)


@dataclass
class ActiveMigration:
    plan: C.MigrationPlan
    request: MigrationRequest
    state: C.MigrationState = C.MigrationState.PREPARING
    t_start: float = field(default_factory=time.time)
    t_go: float | None = None
    switch_step: int | None = None
    result: dict | None = None


class Coordinator:
    """Runs one job. ``run()`` blocks until it ends; ``Job`` in api.py runs it in a thread.
    ``Coordinator.resume(run_dir)`` takes over a running job whose controller died."""

    # what a resumed controller needs, beyond the job spec, the store and the run dir
    # as JSON (``SNAPSHOT_CODEC``): nothing read back from the store is unpickled
    SNAPSHOT = ("membership", "pending", "active", "finished_migrations", "awaiting_downtime",
                "_next_standby", "_store_requests_seen", "restarts", "warm_for",
                "awaiting_recovery", "injects", "cmd_next", "outbox", "procs", "t_started")

    def __init__(self, cfg: JobConfig, run_dir: str, quiet: bool = False,
                 injects: list[Inject] | None = None, timeout_s: float | None = None):
        self.cfg = cfg
        self.run_dir = os.path.abspath(run_dir)
        self.quiet = quiet
        self.injects = sorted(injects or [], key=lambda i: i.step)
        self.timeout_s = timeout_s
        self.requests: queue.Queue[MigrationRequest] = queue.Queue()
        self.pending: list[MigrationRequest] = []
        self.active: ActiveMigration | None = None
        self.finished_migrations: list[dict] = []
        self.awaiting_downtime: list[ActiveMigration] = []
        self.started = threading.Event()
        self._next_standby = cfg.standby.count
        self._store_requests_seen = 0
        self.restarts: list[dict] = []
        self.warm_for: dict[str, list[str]] = {}
        self._standbys_read_at = 0.0
        self._stop_requested = threading.Event()
        self.recovery = Recovery(self)
        self.awaiting_recovery: list = []
        self.cmd_next: dict[str, int] = {}      # next command number per worker
        self.outbox: list[tuple] = []            # ("set", key, value) | ("agent", request)
        self._saved: bytes | None = None
        self._agent_proc: subprocess.Popen | None = None
        self._incarnation_checked_at = 0.0
        self.t_started = time.time()
        self.resumed = False

    # --- set-up ----------------------------------------------------------------------------
    def _prepare(self) -> None:
        if os.path.exists(os.path.join(self.run_dir, "job.json")):
            raise ValueError(f"run dir {self.run_dir!r} already holds a job; choose a new "
                             f"--run-dir")
        os.makedirs(os.path.join(self.run_dir, "logs"), exist_ok=True)
        with open(os.path.join(self.run_dir, "job.json"), "w") as f:
            json.dump(self.cfg.to_dict(), f, indent=2)
        self.events = EventLog(os.path.join(self.run_dir, "events.jsonl"), worker="coordinator")
        host = self.cfg.process.store_host
        # the store's socket is opened here and inherited by the agent, which starts the
        # first processes before it even imports torch: no start-up latency is added
        listener = socket.create_server((host, 0), backlog=1024)
        self.store_addr = f"{host}:{listener.getsockname()[1]}"
        workers = worker_names(self.cfg.layout.num_roles)
        standbys = worker_names(self.cfg.standby.count, "s")
        self.membership = C.Membership.initial(self.cfg.layout, workers, standbys)
        self.procs = AgentClient(None)
        initial = [self._spawn_request(n, standby=False) for n in workers] + \
                  [self._spawn_request(n, standby=True) for n in standbys]
        init_path = os.path.join(self.run_dir, "agent_initial.json")
        with open(init_path, "w") as f:
            json.dump(initial, f)
        # the agent reads its settings from job.json, written above
        with open(os.path.join(self.run_dir, "logs", "agent.log"), "ab") as log:
            self._agent_proc = subprocess.Popen(
                [sys.executable, "-m", "trainmover.agent", "--run-dir", self.run_dir,
                 "--host", host, "--port", str(listener.getsockname()[1]),
                 "--listen-fd", str(listener.fileno()), "--initial", init_path,
                 "--controller-pid", str(os.getpid())],
                pass_fds=[listener.fileno()], stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)  # outlives this process, and the terminal's Ctrl-C
        listener.close()
        with open(os.path.join(self.run_dir, "control.json"), "w") as f:
            json.dump({"store": self.store_addr, "agent_pid": self._agent_proc.pid}, f)
        self._connect()
        self.procs.store = self.store
        for name, role in self.membership.workers.items():
            self.put(P.membership_key(name), role.name)
        self.progress = Progress(os.path.join(self.run_dir, "metrics.jsonl"),
                                 self.cfg.train.steps, not self.quiet)

    def _connect(self, store=None) -> None:
        """Connect (or adopt ``store``) and register as the job's controller."""
        import torch.distributed as dist

        host, _, port = self.store_addr.rpartition(":")
        self.store = store or dist.TCPStore(
            host, int(port), is_master=False,
            timeout=timedelta(seconds=self.cfg.comm.store_timeout_s))
        self.incarnation = self.store.add(P.CONTROLLER_INCARNATION_KEY, 1)
        self.store.set(P.CONTROLLER_KEY, P.encode({"pid": os.getpid(),
                                                   "incarnation": self.incarnation}))

    def _spawn_request(self, name: str, standby: bool, extra: list[str] = ()) -> dict:
        env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS",
                                                 str(self.cfg.threads_per_worker())),
               "PYTHONUNBUFFERED": "1"}
        if self.cfg.process.isolate_caches:
            # one "machine" per process: its own compiler caches, kept across its restarts
            root = os.path.join(self.run_dir, "cache", name)
            env.update(TORCHINDUCTOR_CACHE_DIR=os.path.join(root, "inductor"),
                       TRITON_CACHE_DIR=os.path.join(root, "triton"),
                       TMPDIR=os.path.join(root, "tmp"))
        argv = [sys.executable, "-m", "trainmover.worker", "--run-dir", self.run_dir,
                "--name", name, "--store", self.store_addr, *extra]
        if standby:
            argv.append("--standby")
        return self.procs.spawn_request(name, argv, env,
                                        os.path.join(self.run_dir, "logs", f"{name}.log"),
                                        standby)

    def _spawn(self, name: str, standby: bool, extra: list[str] = ()) -> None:
        self.outbox.append(("agent", self._spawn_request(name, standby, extra)))

    # --- the outbox and the snapshot --------------------------------------------------------
    def put(self, key: str, value: str) -> None:
        """Set a store key the workers act on, once the snapshot that led to it is saved."""
        self.outbox.append(("set", key, value))

    def send(self, worker: str, command: P.Command) -> None:
        index = self.cmd_next.get(worker, 1)
        self.cmd_next[worker] = index + 1
        self.put(P.command_key(worker, index), P.encode_command(command))

    def _flush(self) -> None:
        """Save the snapshot (if anything changed), then send the outbox."""
        state = {k: getattr(self, k) for k in self.SNAPSHOT}
        state["recovery"] = self.recovery.snapshot()
        blob = SNAPSHOT_CODEC.dumps(state)
        if blob != self._saved:
            self.store.set(P.CONTROLLER_SNAPSHOT_KEY, blob)
            self._saved = blob
        if not self.outbox:
            return
        for item in self.outbox:
            if item[0] == "set":
                self.store.set(item[1], item[2])
            else:
                self.procs.send(item[1])
        self.outbox = []

    @classmethod
    def resume(cls, run_dir: str, quiet: bool = False, force: bool = False) -> "Coordinator":
        """A controller for a job whose controller died: the same view, rebuilt from the
        store (its snapshot, the agent's process records) and the run dir (job spec, metrics,
        checkpoints)."""
        run_dir = os.path.abspath(run_dir)
        for name in ("job.json", "control.json"):
            if not os.path.exists(os.path.join(run_dir, name)):
                raise ValueError(f"{run_dir!r} holds no running job (no {name})")
        with open(os.path.join(run_dir, "job.json")) as f:
            cfg = JobConfig.from_dict(json.load(f))
        with open(os.path.join(run_dir, "control.json")) as f:
            control = json.load(f)
        if not pid_alive(control["agent_pid"]):
            raise ValueError(f"the job in {run_dir!r} has ended (its agent, PID "
                             f"{control['agent_pid']}, is gone)")
        self = cls(cfg, run_dir, quiet)
        self.store_addr = control["store"]
        import torch.distributed as dist

        host, _, port = self.store_addr.rpartition(":")
        probe = dist.TCPStore(host, int(port), is_master=False,
                              timeout=timedelta(seconds=cfg.comm.store_timeout_s))
        if probe.check([P.CONTROLLER_KEY]):
            current = P.decode(probe.get(P.CONTROLLER_KEY))
            if pid_alive(current["pid"]) and current["pid"] != os.getpid() and not force:
                raise ValueError(f"the job's controller (PID {current['pid']}) is alive; "
                                 f"pass --force to take over anyway")
        if not probe.check([P.CONTROLLER_SNAPSHOT_KEY]):
            raise ValueError(f"the job in {run_dir!r} has no controller snapshot yet")
        state = SNAPSHOT_CODEC.loads(probe.get(P.CONTROLLER_SNAPSHOT_KEY))
        self._connect(probe)   # one client: the one that read the snapshot
        recovery = state.pop("recovery")
        for k, v in state.items():
            setattr(self, k, v)
        self.recovery.restore(recovery)
        self.procs.store = self.store
        self.resumed = True
        self.recovery.disrupted()   # heartbeats and step times are judged afresh
        self.events = EventLog(os.path.join(run_dir, "events.jsonl"), worker="coordinator")
        self.progress = Progress(os.path.join(run_dir, "metrics.jsonl"), cfg.train.steps, False)
        self.progress.poll()          # catch up silently, then report new steps as usual
        self.progress.enabled = not quiet
        # a request number taken by a controller that died before writing it would stall
        # the agent's queue: fill such holes with no-ops
        count = self.store.add(P.AGENT_REQUEST_COUNT_KEY, 0)
        for i in range(1, count + 1):
            if not self.store.check([P.agent_request_key(i)]):
                self.store.set(P.agent_request_key(i), P.encode({"op": "noop"}))
        return self

    # --- the run -----------------------------------------------------------------------------
    def run(self) -> dict:
        cfg = self.cfg
        if not self.resumed:
            self._prepare()
            self.events.emit("job_started", layout=cfg.layout.as_dict(),
                             workers=len(self.membership.workers),
                             standbys=len(self.membership.standbys), store=self.store_addr,
                             agent_pid=self._agent_proc.pid)
            self.progress.say(f"job {cfg.name!r} {cfg.layout} on "
                              f"{len(self.membership.workers)} workers + "
                              f"{len(self.membership.standbys)} standby, "
                              f"{cfg.model.num_params() / 1e6:.2f}M parameters, run dir "
                              f"{self.run_dir}")
        else:
            self.events.emit("controller_resumed", incarnation=self.incarnation,
                             pid=os.getpid(), last_step=self.progress.last_step,
                             active_migration=None if self.active is None
                             else self.active.plan.migration_id,
                             active_recovery=None if self.recovery.active is None
                             else self.recovery.active.recovery_id)
            self.progress.say(f"controller resumed (incarnation {self.incarnation}) at step "
                              f"{self.progress.last_step + 1} of job {cfg.name!r}")
        t0 = time.perf_counter()
        try:
            self._flush()   # a resumed controller re-sends what its predecessor may not have
            self.started.set()
            while not self._stop_requested.is_set() and not self._poll():
                self._flush()
                if self.timeout_s is not None and time.perf_counter() - t0 > self.timeout_s:
                    raise JobFailed(f"job exceeded its timeout of {self.timeout_s} s")
                time.sleep(cfg.controller.poll_s)
            self._flush()
        except Superseded:
            self.started.set()
            raise
        except BaseException as exc:
            try:
                self._fail_requests(exc)
                self._flush()
            except Exception:  # noqa: BLE001 - the store may be what failed; stop anyway
                pass
            if hasattr(self, "store"):
                self._stop_all()
            elif self._agent_proc is not None:
                self._agent_proc.kill()   # its workers die with it (PR_SET_PDEATHSIG)
            raise
        finally:
            self.started.set()
        self._stop_all()  # standbys still waiting
        self.progress.poll()
        self._finish_downtimes(final=True)
        wall = time.time() - self.t_started
        if self._stop_requested.is_set():
            # stopped on request (benchmarks): no final state, but every event's accounting
            self.events.emit("job_stopped", wall_s=round(wall, 3),
                             last_step=self.progress.last_step)
            return {"stopped": True, "steps": self.progress.last_step + 1,
                    "wall_s": round(wall, 3), "migrations": self.finished_migrations,
                    "restarts": self._restart_report(), "recoveries": self.recovery.done}
        summary = self._finish(wall)
        self.events.emit("job_done", wall_s=round(wall, 3),
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
        latest = self.store.add(P.CONTROLLER_INCARNATION_KEY, 0)
        if latest != self.incarnation:
            raise Superseded(f"controller incarnation {latest} took over from "
                             f"{self.incarnation}")

    def _poll(self) -> bool:
        """One round of supervision; True when the job has finished."""
        self._check_incarnation()
        self.procs.refresh()
        self.progress.poll()
        self._check_processes()
        self._update_standbys()
        if self.cfg.health.recover:
            self.recovery.poll()
        self._collect_requests()
        self._fire_injects()
        if self.recovery.active is None and self._job_finished():
            return True
        if self.active is None and self.pending and self.recovery.active is None:
            self._start_migration(self.pending.pop(0))
        if self.active is not None:
            self._advance_migration()
        self._finish_downtimes()
        return False

    def _job_finished(self) -> bool:
        """Every role holder exited cleanly (checked before migrations advance: a joiner
        whose leaver finished the job first loses its channel, which is not a failure)."""
        if not all(self.procs.exit_code(w) == 0 for w in self.membership.workers):
            return False
        if self._restart_due():
            self._restart()
            return False
        if self.active is not None:
            if self._all_switched(self.active):
                self._complete(self.active)  # finished in the same poll as the job
            else:
                # the job ended before the switch boundary was reached: nothing changed
                self._abort_active("the job finished before the switch step")
        return True

    def _all_switched(self, mig: ActiveMigration) -> bool:
        count = self.store.add(P.mig_key(mig.plan.migration_id, "switched_count"), 0)
        return count >= len(mig.plan.participants)

    # --- the restart baseline ------------------------------------------------------------------
    def _restart_due(self) -> bool:
        k = self.cfg.baseline.restart_at_step
        self.progress.poll()
        planned_done = any(r["cause"] == "planned" for r in self.restarts)
        return k is not None and not planned_done and self.progress.last_step == k - 1

    def _restart(self, step: int | None = None, cause: str = "planned") -> None:
        """What torchrun/Megatron users do: every process is gone; start fresh ones that
        rebuild every group (under a new generation) and reload the last checkpoint. They
        vote in a new epoch, so no decision of the steps they redo is taken as made."""
        k = self.cfg.baseline.restart_at_step if step is None else step
        t = time.time()
        generation = max(self.membership.next_generation.values(), default=1)
        for name in self.membership.next_generation:
            self.membership.generations[name] = generation
            self.membership.next_generation[name] = generation + 1
        self.recovery.epoch += 1
        self.recovery.committed = k - 1
        self.recovery.disrupted()
        self.events.emit("restart_began", step=k, generation=generation, cause=cause)
        self.restarts.append({"step": k, "t_all_stopped": t, "generation": generation,
                              "cause": cause})
        self.progress.say(f"restart ({cause}): all workers stopped; starting fresh processes "
                          f"from the step-{k} checkpoint")
        for name in self.membership.workers:
            self._spawn(name, standby=False,
                        extra=["--resume-step", str(k), "--generation", str(generation),
                               "--epoch", str(self.recovery.epoch)])

    def _restart_report(self) -> list[dict]:
        out = []
        events = read_jsonl(os.path.join(self.run_dir, "events.jsonl"))
        for r in self.restarts:
            k = r["step"]
            if self.progress.last_step < k:
                continue
            downtime, normal = downtime_from_metrics(self.progress.records, k)
            later = [e for e in events if e["time"] >= r["t_all_stopped"]]

            def longest(event, key="duration_s"):
                return max([e.get(key, 0.0) for e in later if e["event"] == event] or [0.0])

            prev = next(x["time"] for x in self.progress.records if x["step"] == k - 1)
            first = next(x for x in self.progress.records
                         if x["step"] == k and x["time"] > r["t_all_stopped"])
            if r["cause"] != "planned":
                # from the fault to the first step committed after the restart
                faults = [e["time"] for e in self.fault_events() if e["time"] <= r["t_all_stopped"]]
                t_fault = max(faults) if faults else r["t_all_stopped"]
                downtime = first["time"] - t_fault
                prev = t_fault
            out.append({"step": k, "cause": r["cause"], "downtime_s": downtime, "phases": {
                "stop_s": r["t_all_stopped"] - prev,
                "process_start_import_s": longest("worker_started", "import_s"),
                "groups_s": longest("groups_built"),
                "checkpoint_load_s": longest("checkpoint_loaded"),
                "first_step_s": first["step_time_s"],
                "normal_step_s": normal}})
        return out

    def _check_processes(self) -> None:
        for name, p in self.procs.procs.items():
            code = p.code
            if code in (None, 0):
                continue
            if code == P.EXIT_USAGE:
                raise JobFailed(f"{name}: the training script misuses the runtime (exit code "
                                f"{code}); last log lines:\n{self.procs.tail(name)}")
            if p.standby and self.store.check([P.standby_refused_key(name)]):
                raise JobFailed(f"standby {name} refused to serve: "
                                f"{self.store.get(P.standby_refused_key(name)).decode()}")
            if p.standby and name not in self.membership.workers:
                if self.membership.standbys.get(name) not in (C.StandbyState.DEAD, None):
                    self.membership.standbys[name] = C.StandbyState.DEAD
                    self.events.emit("standby_died", name=name, code=code)
                    self.progress.say(f"standby {name} exited with code {code}")
                continue
            if self.cfg.health.recover and name in self.membership.workers:
                continue  # the recovery path detects, fences and replaces it
            if name in self.membership.departed or name in self.recovery.failed_workers:
                continue
            raise JobFailed(f"worker {name} exited with code {code}; last log lines:\n"
                            f"{self.procs.tail(name)}")

    def _update_standbys(self) -> None:
        """Follow each free standby's readiness (cold, warming, warm) as it reports it."""
        now = time.monotonic()
        if now - self._standbys_read_at < self.cfg.controller.standby_poll_s:
            return
        self._standbys_read_at = now
        for name, st in self.membership.standbys.items():
            if st in (C.StandbyState.DEAD, C.StandbyState.RESERVED) or \
                    not self.procs.known(name) or \
                    not self.store.check([P.standby_state_key(name)]):
                continue
            value = self.store.get(P.standby_state_key(name)).decode()
            if value == "refused":
                reason = self.store.get(P.standby_refused_key(name)).decode() \
                    if self.store.check([P.standby_refused_key(name)]) else "no reason given"
                raise JobFailed(f"standby {name} refused to serve: {reason}")
            new = C.StandbyState(value)
            warm_for = P.decode(self.store.get(P.standby_state_key(name) + "/warm_for"))
            if new is not st or warm_for != self.warm_for.get(name):
                self.membership.standbys[name] = new
                self.warm_for[name] = warm_for
                self.events.emit("standby_state", name=name, state=new.value, warm_for=warm_for)
                self.progress.say(f"standby {name}: {new.value}" +
                                  (f" for {', '.join(warm_for)}" if warm_for else ""))

    # --- requests ----------------------------------------------------------------------------
    def request_migration(self, workers: list[str], targets: list[str] | None = None,
                          naive: bool = False, source: str = "api") -> Future:
        req = MigrationRequest(list(workers), list(targets) if targets else None, source,
                               naive=naive)
        self.requests.put(req)
        return req.future

    def _collect_requests(self) -> None:
        while True:
            try:
                self.pending.append(self.requests.get_nowait())
            except queue.Empty:
                break
        count = self.store.add(P.REQUEST_COUNT_KEY, 0)
        while self._store_requests_seen < count:
            self._store_requests_seen += 1
            idx = self._store_requests_seen
            body = P.decode(self.store.get(P.request_key(idx)))
            req = MigrationRequest(body["workers"], body.get("to"), "cli", store_index=idx)
            self.pending.append(req)
            if self.active is not None or len(self.pending) > 1:
                self._answer(req, {"status": "queued",
                                   "reason": "another migration is in flight"}, final=False)

    def controller_fault(self, point: str) -> None:
        """A scheduled crash of this controller process at ``point`` (tests, chaos): it is
        taken off the schedule and the snapshot saved first, so the controller that resumes
        does not crash again, then SIGKILL, no clean-up."""
        due = [i for i in self.injects if i.target == "controller" and
               (i.arg or "boundary") == point and i.step <= self.progress.last_step + 1]
        if not due:
            return
        self.injects = [i for i in self.injects if i is not due[0]]
        self.events.emit("fault_injected", kind="crash", point=point, target="controller",
                         step=self.progress.last_step + 1, pid=os.getpid())
        self._flush()
        os.kill(os.getpid(), signal.SIGKILL)

    def _fire_injects(self) -> None:
        self.controller_fault("boundary")
        due = [i for i in self.injects if i.step <= self.progress.last_step + 1
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
                self.events.emit("inject", kinds=[str(i) for i in migrations],
                                 at_step=self.progress.last_step + 1)
                self.pending.append(MigrationRequest(
                    [i.target for i in migrations],
                    targets if all(targets) else None, "inject"))

    def _answer(self, req: MigrationRequest, result: dict, final: bool = True) -> None:
        if req.store_index is not None:
            self.put(P.request_key(req.store_index, "done" if final else "status"),
                     P.encode(result))
        if final and not req.future.done():
            req.future.set_result(result)

    def _fail_requests(self, exc: BaseException) -> None:
        reqs = self.pending + ([self.active.request] if self.active else [])
        for req in reqs:
            self._answer(req, {"status": "failed", "reason": str(exc)})

    # --- migrations --------------------------------------------------------------------------
    def _start_migration(self, req: MigrationRequest) -> None:
        mid = self.store.add(P.MIGRATION_COUNT_KEY, 1)
        targets = req.targets
        if req.naive and not targets:
            # the naive baseline starts a fresh process on the spot: a new standby name
            new = f"s{self._next_standby}"
            self._next_standby += 1
            self.membership.standbys[new] = C.StandbyState.COLD
            targets = [new]
        busy = set()
        try:
            plan = C.plan_migration(self.membership, mid, req.workers, targets, busy,
                                    rebuild_all=req.naive)
        except C.MigrationRefused as exc:
            self.events.emit("migration_refused", migration_id=mid, workers=req.workers,
                             reason=str(exc), source=req.source)
            self.progress.say(f"migration of {', '.join(req.workers)} refused: {exc}")
            self._answer(req, {"status": "refused", "reason": str(exc)})
            return
        self.membership = C.reserve(self.membership, plan)
        mig = ActiveMigration(plan, req)
        self.active = mig
        info = plan.describe()
        self.events.emit("migration_started", source=req.source, naive=req.naive, **info)
        self.progress.say(
            f"migration {mid}: " + ", ".join(f"{p.leaver} -> {p.joiner} ({p.role})"
                                             for p in plan.pairs) +
            f"; rebuilding {info['groups_rebuilt']}/{info['groups_total']} groups"
            + (" [naive]" if req.naive else ""))
        self._answer(req, {"status": "started", **info}, final=False)
        for stayer, groups in plan.stayers.items():
            self.send(stayer, P.Prepare(mid, {g: plan.generations[g] for g in groups},
                                        naive=req.naive))
        for pair in plan.pairs:
            self.send(pair.leaver, P.Leave(mid, pair.joiner, pair.transfer_group, mid,
                                           naive=req.naive))
            role_groups = self.cfg.layout.groups_of(pair.role)
            self.send(pair.joiner, P.AssignMigration(
                mid, pair.role.name, self.recovery.epoch, pair.leaver, pair.transfer_group, mid,
                {s.name: plan.generations[s.name] for s in role_groups.values()
                 if s.name in plan.generations}, naive=req.naive))
        if req.naive:
            # no preparation phase: the switch is ordered at once, the joiner starts cold
            # when the leaver reaches the switch boundary
            self._go(mig)
        self.controller_fault("migration_prepare")

    def _go(self, mig: ActiveMigration) -> None:
        self.recovery.disrupted()
        mig.state, mig.t_go = C.MigrationState.SWITCHING, time.time()
        self.put(P.mig_key(mig.plan.migration_id, "go"), "1")
        self.events.emit("migration_go", migration_id=mig.plan.migration_id)
        self.controller_fault("migration_switch")

    def _advance_migration(self) -> None:
        mig = self.active
        plan, mid = mig.plan, mig.plan.migration_id
        if mig.request.naive:
            for pair in plan.pairs:
                if not self.procs.known(pair.joiner) and \
                        self.store.check([P.mig_key(mid, "at_switch", pair.leaver)]):
                    self._spawn(pair.joiner, standby=True)
        dead = {j for j in plan.joiners
                if self.procs.known(j) and self.procs.exit_code(j) not in (None, 0)}
        participants = set(plan.participants)
        ready = participants if mig.state is not C.MigrationState.PREPARING else \
            (participants if self.store.add(P.mig_key(mid, "ready_count"), 0) >= len(participants)
             else set())
        switched = participants if self._all_switched(mig) else set()
        state, why = C.next_state(mig.state, ready=ready, switched=switched,
                                  participants=participants, dead=dead,
                                  joiners=set(plan.joiners))
        if state is mig.state:
            if dead and mig.state is C.MigrationState.SWITCHING:
                raise JobFailed(f"joiner {sorted(dead)[0]} died during the switch of migration "
                                f"{mid}")
            return
        if state is C.MigrationState.SWITCHING:
            self._go(mig)
        elif state is C.MigrationState.ABORTED:
            self._abort_active(why, dead)
        elif state is C.MigrationState.DONE:
            self._complete(mig)

    def _abort_active(self, reason: str, dead: set[str] = frozenset()) -> None:
        mig = self.active
        mid = mig.plan.migration_id
        self.put(P.mig_key(mid, "abort"), reason)
        self.membership = C.abort(self.membership, mig.plan, set(dead))
        for j in mig.plan.joiners:
            if j not in dead and self.procs.running(j):
                # a joiner that prepared for an abandoned migration holds stale groups: retire
                # it rather than reuse it
                self.procs.stop(j, self.cfg.controller.stop_grace_s)
                self.membership.standbys[j] = C.StandbyState.DEAD
        self.events.emit("migration_aborted", migration_id=mid, reason=reason)
        self.progress.say(f"migration {mid} aborted: {reason}; the job continues unchanged")
        result = {"status": "aborted", "reason": reason, **mig.plan.describe()}
        self.finished_migrations.append(result)
        self._answer(mig.request, result)
        self.active = None

    def _settle_active(self, reason: str) -> None:
        """A failure interrupted the migration in flight: pairs whose state already moved
        are committed (their joiners now take part in the recovery as role holders), the
        others are abandoned."""
        mig = self.active
        plan, mid = mig.plan, mig.plan.migration_id
        # per pair, the leaver's "handover" and this "abort" race on one compare-and-set
        handed = {p.leaver for p in plan.pairs
                  if self.store.compare_set(P.mig_key(mid, "outcome", p.leaver), "",
                                            "abort") == b"handover"}
        if not handed:
            return self._abort_active(reason)
        self.membership, done, rest = C.settle_on_failure(self.membership, plan, handed)
        for p in done:
            self.put(P.membership_key(p.joiner), p.role.name)
        for p in rest:
            if self.procs.running(p.joiner):
                self.procs.stop(p.joiner, self.cfg.controller.stop_grace_s)
                self.membership.standbys[p.joiner] = C.StandbyState.DEAD
        self.put(P.mig_key(mid, "abort"), reason)   # participants still preparing drop it
        result = {"status": "interrupted", "reason": reason, **plan.describe(),
                  "committed_pairs": [p.leaver for p in done],
                  "abandoned_pairs": [p.leaver for p in rest]}
        self.events.emit("migration_interrupted", **result)
        self.progress.say(f"migration {mid} interrupted by a failure: "
                          + ", ".join(f"{p.leaver} -> {p.joiner} kept (state already moved)"
                                      for p in done)
                          + "".join(f"; {p.leaver} -> {p.joiner} abandoned" for p in rest))
        self.finished_migrations.append(result)
        self._answer(mig.request, result)
        self.active = None

    def _complete(self, mig: ActiveMigration) -> None:
        self.recovery.disrupted()
        plan, mid = mig.plan, mig.plan.migration_id
        self.membership = C.commit(self.membership, plan)
        for p in plan.pairs:
            self.put(P.membership_key(p.joiner), p.role.name)
        mig.switch_step = int(self.store.get(P.mig_key(mid, "switch_at")))
        mig.state = C.MigrationState.DONE
        self.active = None
        self.awaiting_downtime.append(mig)

    def fault_events(self) -> list[dict]:
        """The workers' own records of faults injected into them (for detection latency)."""
        return [e for e in read_jsonl(os.path.join(self.run_dir, "events.jsonl"))
                if e["event"] == "fault_injected"]

    def _finish_downtimes(self, final: bool = False) -> None:
        """A migration's (or recovery's) downtime is known once the job has committed the
        first step after it."""
        for rec in list(self.awaiting_recovery):
            if self.progress.last_step < rec.reports["resume_step"] and not final:
                continue
            self.awaiting_recovery.remove(rec)
            self.recovery.report(rec)
        for mig in list(self.awaiting_downtime):
            if self.progress.last_step < mig.switch_step and not final:
                continue
            self.awaiting_downtime.remove(mig)
            self._report(mig)

    def _report(self, mig: ActiveMigration) -> None:
        plan, mid = mig.plan, mig.plan.migration_id
        reports = {w: P.decode(self.store.get(P.mig_key(mid, "switched", w)))
                   for w in plan.participants}
        ready = {w: P.decode(self.store.get(P.mig_key(mid, "ready", w)))
                 for w in plan.participants if self.store.check([P.mig_key(mid, "ready", w)])}
        downtime, normal = (None, None)
        if self.progress.last_step >= mig.switch_step:
            downtime, normal = downtime_from_metrics(self.progress.records, mig.switch_step)
        leaver_r = [reports[p.leaver] for p in plan.pairs]
        joiner_r = [reports[p.joiner] for p in plan.pairs]
        stayer_r = [reports[w] for w in plan.stayers]
        rss_growth = [r["rss_after"]["peak_rss_mb"] / r["rss_before"]["peak_rss_mb"] - 1.0
                      for r in stayer_r if r.get("rss_before") and r.get("rss_after")]
        phases = {
            # training continued through these (not downtime)
            "prepare_s": max([r.get("prepare_s", r.get("build_s", 0.0))
                              for r in ready.values()] or [0.0]),
            "wait_boundary_s": max([r["wait_boundary_s"] for r in leaver_r] or [0.0]),
            # the switch itself
            "transfer_s": max(r["transfer_s"] for r in leaver_r),
            "group_switch_s": max([r.get("build_s", 0.0) + r.get("install_s", 0.0)
                                   if plan.rebuild_all else r.get("install_s", 0.0)
                                   for r in stayer_r] or [0.0]),
            "joiner_recv_s": max(r["recv_s"] for r in joiner_r),
            "first_step_s": max(r["first_step_s"] for r in joiner_r),
            "normal_step_s": normal,
        }
        result = {"status": "done", **plan.describe(), "switch_step": mig.switch_step,
                  "downtime_s": downtime, "phases": phases,
                  "transfer_bytes": sum(r["transfer_bytes"] for r in leaver_r),
                  "stayer_peak_rss_growth": max(rss_growth) if rss_growth else None,
                  "naive": mig.request.naive,
                  "requested_to_done_s": time.time() - mig.t_start}
        self.finished_migrations.append(result)
        self.events.emit("migration_done", **result)
        if downtime is not None:
            self.progress.say(
                f"migration {mid} done at step {mig.switch_step}: downtime {downtime:.3f} s "
                f"(transfer {phases['transfer_s']:.3f} s, group switch "
                f"{phases['group_switch_s']:.3f} s, joiner's first step "
                f"{phases['first_step_s']:.3f} s vs normal {normal:.3f} s); "
                f"{result['groups_rebuilt']}/{result['groups_total']} groups rebuilt")
        self._answer(mig.request, result)

    # --- stopping and the end ------------------------------------------------------------------
    def _stop_all(self) -> None:
        """Every process and the agent stop (the job is over or failed)."""
        ctl = self.cfg.controller
        self.procs.shutdown(ctl.stop_grace_s, ctl.agent_exit_timeout_s)
        if self._agent_proc is not None:
            try:
                self._agent_proc.wait(timeout=ctl.agent_exit_timeout_s)
            except subprocess.TimeoutExpired:
                self._agent_proc.kill()
                self._agent_proc.wait()

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
            "membership": {w: r.name for w, r in sorted(self.membership.workers.items())},
            "weights_sha256": digest,
            "checkpoint": ckpt_dir,
            "wall_s": round(wall_s, 3),
            "mean_step_time_s": statistics.fmean(steady) if steady else None,
            "migrations": self.finished_migrations,
            "restarts": self._restart_report(),
            "recoveries": self.recovery.done,
        }
        with open(os.path.join(self.run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        return summary


SNAPSHOT_CODEC = Codec(
    C.Membership, C.StandbyState, C.MigrationState, C.MigrationPlan, C.RecoveryPlan, C.Pair,
    Role, Layout, MigrationRequest, ActiveMigration, ActiveRecovery, Failure, Inject,
    AgentClient, ProcView)


def run_job(cfg: JobConfig, run_dir: str, quiet: bool = False, timeout_s: float | None = None,
            injects: list[Inject] | None = None) -> dict:
    """Run a job to completion and return its summary (also written to summary.json).
    ``cfg`` must already be validated: nothing here should fail on user input."""
    return Coordinator(cfg, run_dir, quiet, injects, timeout_s).run()
