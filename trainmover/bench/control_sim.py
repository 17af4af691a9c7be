"""The simulated hosts of ``trainmover bench control``: thousands of agents and workers as
greenlets (gevent) in one process, speaking the job's real protocol to its real store and
controller. Run by the benchmark (``python -m trainmover.bench.control_sim``), never by a job.

What runs as in a job, and what stands in for it:
- as in a job: each host's agent (``agent.main.Agent``: its request feed, its host's
  heartbeat with its processes' beats, fencing watch, process and exit records), and each
  worker's control code: its heartbeat (``worker.liveness.Heartbeat``, on its channel to
  the agent), its watch of the controller's aborts, commit vote and commands (``Inbox``,
  ``HostVote``, ``worker.commands.CommandChannel``: through the agent), a planned
  migration's stayers and leaver (``worker.migration.Migrations``, ``bench/sim_migration.py``),
  its store traffic with its own authenticated store client, writing signed messages, as a
  worker does;
- stood in for: a step's compute (a wait of ``compute_s``, cut short by an abort); a process
  (a greenlet whose store connections are closed when it is "killed"); tensors (none: a state
  transfer takes no time; a migration's leaver hands nothing over, ``sim_migration``); a
  group's rendezvous (its store traffic as the job's backend makes it: gloo's addresses, in
  fewer requests, or NCCL's unique id; ``_rendezvous``); the failure report's accounting
  (every group clean: the step's collectives are not simulated).

Each worker records, per committed step, its *control overhead*: the time from one decision
it saw to the next, less the step's compute. That is what the control plane adds to a step
(the vote, and the skew of the step starts its decisions fan out), and what the benchmark
reports. One process (``--part I/K``: each of K processes) runs the simulated hosts (those
whose number is I modulo K): its CPU is the simulator's limit, reported beside the figures
(``sim_cpu_share``: the busiest process's).
"""
from gevent import monkey

monkey.patch_all()   # before anything imports socket, threading or time's sleep

import argparse  # noqa: E402
import errno  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import gevent  # noqa: E402
import gevent.event  # noqa: E402

from trainmover.agent.main import Agent  # noqa: E402
from trainmover.comm.groups import AbortSignal  # noqa: E402
from trainmover.core import jobfile  # noqa: E402
from trainmover.core import protocol as P  # noqa: E402
from trainmover.core.events import EventLog, JsonlWriter  # noqa: E402
from trainmover.bench import sim_migration as SM  # noqa: E402
from trainmover.bench.sim_parts import (Crash, Samples, SimChild, SimProcess, SimSpec,  # noqa: E402
                                        SimStores, _Recovers)
from trainmover.core.proc import PR_SET_PDEATHSIG, prctl, raise_open_files  # noqa: E402
from trainmover.core.topology import Role, reporter_role  # noqa: E402
from trainmover.worker.liveness import AbortWatcher, Heartbeat, HostVote, Inbox  # noqa: E402
from trainmover.worker.commands import CommandChannel  # noqa: E402

# How far apart a light worker waiting for a command checks its store (``LightWorker``).
LIGHT_CHECK_S = 30.0


def _trace(line: str) -> None:
    """A whole host's part in a recovery, in the simulator's log (kept with ``--keep``): a
    survivor fenced for a report its host did not relay is told apart from one never sent."""
    print(f"simulator: {time.time():.3f} {line}", file=sys.stderr, flush=True)


class _TracedReports:
    """A whole host's report relay (``agent/reports.py``), each report it hears and each
    value it writes traced (``_trace``)."""

    def __init__(self, reports):
        self._inner = reports
        reports.store = _TracedStore(reports.store, reports.node)

    def received(self, name: str, epoch: int, payload: bytes) -> None:
        _trace(f"agent{self._inner.node} heard {name}'s report of epoch {epoch}")
        self._inner.received(name, epoch, payload)

    def __getattr__(self, attr):
        return getattr(self._inner, attr)


class _TracedStore:
    def __init__(self, store, node: int):
        self._inner, self._node = store, node

    def set(self, key: str, value) -> None:
        self._inner.set(key, value)
        _trace(f"agent{self._node} wrote {key} ({len(value)} bytes)")

    def __getattr__(self, attr):
        return getattr(self._inner, attr)


class SimWorker(_Recovers):
    """One worker or standby: its control code as in a job, its compute and tensors
    stood in for (module doc)."""

    def __init__(self, agent: "SimAgent", req: P.AgentSpawn, channel: socket.socket):
        self.agent, self.cfg = agent, agent.cfg
        self.channel = channel       # its end of its channel to the agent
        self.name, self.standby = req.name, req.standby
        self.layout = self.cfg.layout
        self.stores = SimStores(*agent.endpoint(), agent.run_key,
                                self.cfg.comm.group_timeout_s)
        self.proc = SimProcess(self)
        self.role: Role | None = None
        self.epoch, self.step = 0, 0
        self.generations: dict[str, int] = {}
        self.collectives = 0
        self.taking_over = None      # a migration's joiner before its first step: (cmd, t)
        self.greenlet = gevent.spawn(self._run)

    def _run(self) -> None:
        code = 0
        try:
            self._main()
        except gevent.GreenletExit:
            return
        except Crash:
            code = -signal.SIGKILL
        except Exception as exc:  # noqa: BLE001 - the process "exits" with an error
            if not self.stores.closed:
                print(f"simulator: {self.name}: {type(exc).__name__}: {exc}", file=sys.stderr,
                      flush=True)
            code = 1
        self.proc.exit(code)

    # --- a worker's life ------------------------------------------------------------------
    def _main(self) -> None:
        store = self.stores.get()
        cfg = self.cfg
        Heartbeat(self.channel, self.name, cfg.health.heartbeat_interval_s)
        self.inbox = Inbox(self.channel, self.stores)
        self.commands = CommandChannel(self.stores, self.inbox, self.name)
        if self.standby:
            store.set(P.standby_state_key(self.name),
                      P.write_message(P.StandbyReport("warm")))
            cmd = self.commands.next()
            if isinstance(cmd, P.AssignRecovery):
                self._join(cmd)
            elif isinstance(cmd, P.AssignMigration):
                self.step, t_at = SM.take_over(self, cmd)
                self.epoch, self.taking_over = cmd.epoch, (cmd, t_at)
            else:
                raise RuntimeError(f"{type(cmd).__name__} is not simulated yet")
        else:
            self.role = Role.parse(store.get(P.membership_key(self.name)).decode())
        self.migrations = SM.SimMigrations(self)
        while self.step < cfg.train.steps:
            if self._train() == SM.M.LEAVE:
                return                   # a migration's leaver: its role is the joiner's
        store.set(P.finished_key(self.name), "1")

    def _train(self) -> None:
        """Steps of one epoch, until the job's end or a failed step (then recovered)."""
        spec, cfg = self.agent.spec, self.cfg
        reporter = self.role == reporter_role(self.layout)
        metrics = JsonlWriter(os.path.join(self.agent.run_dir, "metrics.jsonl")) \
            if reporter else None
        abort = self._plan_abort(self.epoch)
        vote = HostVote(self.inbox, self.stores, self.epoch, abort,
                        self.name if reporter else None, voter=self.name)
        last = time.time()
        while self.step < cfg.train.steps:
            if self.migrations.at_boundary(self.step) == SM.M.LEAVE:
                return SM.M.LEAVE
            if spec.crashes.get(self.name) == self.step:
                EventLog(os.path.join(self.agent.run_dir, "events.jsonl"),
                         worker=self.name).emit("fault_injected", kind="crash",
                                                step=self.step, point="compute")
                raise Crash()
            aborted = abort.wait(spec.compute_s)
            t_vote = time.time()
            ok = not aborted and vote(self.step, {"loss": 0.0, "epoch": self.epoch,
                                                  "step_time_s": t_vote - last})
            now = time.time()
            if not ok:
                self._recover()
                return
            self.agent.samples.add(self.name, self.epoch, self.step, now,
                                   now - last - spec.compute_s, now - t_vote)
            if metrics is not None:
                metrics.write({"step": self.step, "loss": 0.0, "epoch": self.epoch,
                               "worker": self.name, "step_time_s": round(now - last, 6)})
            self.migrations.step_ended(self.step, now)
            if self.taking_over is not None:
                cmd, t_at = self.taking_over
                self.taking_over = None
                SM.joiner_started(self, cmd, self.step, t_at, now - last)
            last = now
            self.collectives += 1
            self.step += 1
            if self.step % cfg.straggler.window == 0:
                self._perf()

    def _send_perf(self, message: bytes) -> None:
        self.inbox.send(message)

    def _send_report(self, epoch: int, report: P.FailureReport) -> None:
        _trace(f"{self.name} reports epoch {epoch} step {report.step}")
        self.inbox.send(P.report_message(epoch, report))

    def _send_recovered(self, recovery_id: int) -> None:
        self.inbox.send(P.recovered_message(recovery_id))

    def _join(self, cmd: P.AssignRecovery) -> None:
        """A standby promoted by a recovery: the role's groups, its state's channels."""
        self.role = Role.parse(cmd.role)
        self._rebuild(cmd.groups)
        src = cmd.source
        if src.kind == "replica":
            for channel in [src.transfer_group, *(src.more_groups or [])]:
                self._rendezvous(channel, src.transfer_generation, 1, 2)
        self._send_recovered(cmd.recovery_id)
        self.epoch, self.step = cmd.epoch, cmd.resume_step


class SimAgent(Agent):
    """A host's agent as in a job, its processes simulated workers."""

    def __init__(self, run_dir: str, host: str, port: int, cfg, node: int, spec: SimSpec,
                 samples: Samples, run_key: bytes):
        super().__init__(run_dir, f"{host}:{port}", cfg, node=node)
        self.host, self.port = host, port       # the simulated processes' store clients
        self.spec, self.samples, self.run_key = spec, samples, run_key

    def endpoint(self) -> tuple[str, int]:
        """Where its simulated processes reach the store: the host's door, as a job's
        processes do (``comm.store_proxy``), or the store."""
        host, _, port = self.process_store.rpartition(":")
        return host, int(port)

    def spawn(self, req: P.AgentSpawn) -> None:
        old = self.children.get(req.name)
        if old is not None and old.incarnation >= req.incarnation:
            return
        if old is not None and old.proc.poll() is None:
            self._kill(old)
        if not isinstance(self._reports, _TracedReports):
            self._reports = _TracedReports(self._reports)
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        mine.setblocking(False)
        worker = SimWorker(self, req, theirs)
        self.children[req.name] = child = SimChild(req.name, req.incarnation, worker.proc,
                                                   channel=mine)
        self._track(child, req.standby)
        self.store.set(P.agent_proc_key(req.name),
                       P.write_message(P.ProcRecord(worker.proc.pid, req.incarnation)))



class LightWorker(_Recovers):
    """A worker of a light host: its own store traffic as a worker's (rendezvous, a
    migration's reports), but for its beats and votes, which its agent makes for all of its
    workers at once, its commands, which its agent puts in its queue instead of on a
    channel, and its step measurements, failure reports and notes of a recovery done, which
    it hands its agent as its channel's reader would (``LightAgent``)."""

    def __init__(self, agent: "LightAgent", req: P.AgentSpawn):
        self.agent, self.cfg, self.layout = agent, agent.cfg, agent.cfg.layout
        self.name, self.channel = req.name, None
        self.stores = SimStores(*agent.endpoint(), agent.run_key,
                                self.cfg.comm.group_timeout_s, shared=True)
        self.proc = SimProcess(self)
        self.role: Role | None = None
        self.epoch, self.step, self.collectives = 0, 0, 0
        self.generations: dict[str, int] = {}
        self.ready = gevent.event.Event()
        self.greenlet = gevent.spawn(self._start)

    def _plan_abort(self, epoch: int) -> AbortSignal:
        return self.agent.abort_of(epoch)     # one watch a host (a connection each)

    def _send_perf(self, message: bytes) -> None:
        self.agent._perfs.received(self.name, P.read_perf_message(message))

    def _send_report(self, epoch: int, report: P.FailureReport) -> None:
        self.agent._reports.received(self.name, epoch, P.write_message(report).encode())

    def _send_recovered(self, recovery_id: int) -> None:
        self.agent._reports.recovered(self.name, recovery_id)

    def _start(self) -> None:
        store = self.stores.get()        # kept for the worker's life (shared)
        self.role = Role.parse(store.get(P.membership_key(self.name)).decode())
        # filled by its agent; its waits check the store (a ping its door answers: host-local
        # traffic, left out as its channel is) LIGHT_CHECK_S apart, not every second: at
        # 16K workers the survivors' once-a-second wake-ups and pings were 2/3 of the
        # simulator's CPU while a recovery was planned (py-spy), time taken from the hosts
        # whose traffic the root store and the controller do see
        self.commands = CommandChannel(self.stores, None, self.name, check_s=LIGHT_CHECK_S)
        self.migrations = SM.SimMigrations(self)
        self.ready.set()


class LightAgent(SimAgent):
    """A host's agent as in a job (its request feed, heartbeat, fencing watch, records and
    vote relay), whose workers are light (``LightWorker``): each step, after the compute,
    it hands the relay a vote for each of them and waits for the decision, as their
    channels would; their beats move every heartbeat interval; one watch of each epoch's
    abort for all of them, as the agent's relay keeps (``agent/aborts.py``). What it
    leaves out: the host's local traffic (channels; its waiting workers' pings of its door,
    thinned to one in ``LIGHT_CHECK_S``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._decisions: dict[tuple[int, int], bytes] = {}
        self._decided = gevent.event.Event()
        self._epoch_aborts: dict[int, AbortSignal] = {}
        self._abort_stores: SimStores | None = None    # once the host's door is open
        gevent.spawn(self._steps)
        gevent.spawn(self._beats)

    def spawn(self, req: P.AgentSpawn) -> None:
        if req.standby:
            raise RuntimeError(f"standby {req.name} on a light host")
        worker = LightWorker(self, req)
        self.children[req.name] = child = SimChild(req.name, req.incarnation, worker.proc)
        child.worker = worker
        self._track(child, req.standby)
        self.store.set(P.agent_proc_key(req.name),
                       P.write_message(P.ProcRecord(worker.proc.pid, req.incarnation)))

    def _track(self, child, standby: bool) -> None:
        child.standby = standby
        if self._relay is not None and not standby:
            self._relay.expect(child.name)

    def deliver(self, name: str, message: bytes) -> str:
        """A command to a light worker: into its queue, as its channel's reader would."""
        child = self.children.get(name)
        if child is None or not child.worker.ready.is_set():
            return "unknown"
        if child.proc.poll() is not None:
            return "gone"
        child.worker.commands.queue.put(P.decode_command(P.read_command_message(message)))
        return "sent"

    def _on_decided(self, key, value) -> None:
        self._decisions[key] = value
        self._decided.set()

    def abort_of(self, epoch: int) -> AbortSignal:
        """The host's one watch of ``epoch``'s abort, shared by its light workers."""
        if self._abort_stores is None:
            self._abort_stores = SimStores(*self.endpoint(), self.run_key,
                                           self.cfg.comm.group_timeout_s)
        if epoch not in self._epoch_aborts:
            self._epoch_aborts[epoch] = signal = AbortSignal()
            AbortWatcher(self._abort_stores, signal, epoch)
            gevent.spawn(self._tell_reports, epoch, signal)
        return self._epoch_aborts[epoch]

    def _tell_reports(self, epoch: int, signal: AbortSignal) -> None:
        """The abort to the host's report relay, as an agent's abort watch tells it."""
        while not signal.wait(P.IDLE_WAIT_S):
            pass
        self._reports.aborted(epoch)

    def _beats(self) -> None:
        while True:
            now = time.monotonic()
            for c in list(self.children.values()):
                c.beats += 1
                c.beat_at = now
            time.sleep(self.cfg.health.heartbeat_interval_s)

    def _steps(self) -> None:
        per_node = self.cfg.hosts.per_node(self.cfg.layout.num_roles)
        mine = sum(1 for i in range(self.cfg.layout.num_roles) if i // per_node == self.node)
        while self._relay is None or len(self.children) < mine:
            time.sleep(0.01)
        self._relay.on_decided = self._on_decided
        workers = [c.worker for c in self.children.values()]
        for w in workers:
            w.ready.wait()
        epoch, step, compute_s = 0, 0, self.spec.compute_s
        while True:
            abort = self.abort_of(epoch)
            last = time.time()
            while True:
                for w in workers:            # their boundary: a migration's commands
                    if w.migrations.at_boundary(step) == SM.M.LEAVE:
                        raise RuntimeError(f"{w.name} of a light host left: not simulated")
                if abort.wait(compute_s):
                    break
                key = (epoch, step)
                t_vote = time.time()
                for w in workers:
                    self._relay.vote(self.children[w.name], epoch, step, w.name)
                while key not in self._decisions and not abort.is_set():
                    self._decided.clear()
                    if key not in self._decisions:
                        self._decided.wait(0.05)
                if self._decisions.pop(key, None) != b"commit":
                    break          # aborted: recovered below
                now = time.time()
                self.samples.add(f"host{self.node}", epoch, step, now,
                                 now - last - compute_s, now - t_vote)
                last, step = now, step + 1
                for w in workers:
                    w.migrations.step_ended(step - 1, now)
                    w.step, w.collectives = step, w.collectives + 1
                    if step % self.cfg.straggler.window == 0:
                        w._perf()
            for w in workers:
                w.epoch, w.step = epoch, step
            jobs = [gevent.spawn(w._recover) for w in workers]
            gevent.joinall(jobs, raise_error=True)
            epoch, step = workers[0].epoch, workers[0].step


def _out_of_descriptors(exc: BaseException | None) -> bool:
    """Whether ``exc`` or what caused it is a descriptor refused (a store client's connect
    retries one until its timeout, then says it could not connect)."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _fatal_on_no_descriptors() -> None:
    """Any greenlet that fails for want of a descriptor ends the simulator, as an agent's
    failure does (``_serve``): a simulated worker that could not open its store client
    would stall the job on the simulator's limit, not the control plane's."""
    hub = gevent.get_hub()
    report = hub.handle_error

    def handle_error(context, kind, value, tb):
        report(context, kind, value, tb)
        if _out_of_descriptors(value):
            sys.stderr.flush()
            print(f"simulator: out of descriptors (this process's limit: "
                  f"{resource.getrlimit(resource.RLIMIT_NOFILE)[0]}): {value!r}", flush=True)
            os._exit(3)

    hub.handle_error = handle_error


def _serve(agent: SimAgent) -> None:
    """An agent's loop; an error out of it ends the simulator. The benchmark crashes a
    worker, never an agent: an agent that fails is the simulator's own limit (its
    descriptors, at 8K workers in two processes with the hosts' doors), and a host that
    never connects would only show later as a recovery before any step, on the wrong
    cause. The benchmark sees the process end and reports its log's last line."""
    try:
        agent.serve([])
    except BaseException as exc:  # noqa: BLE001 - reported, then the process ends
        traceback.print_exc()
        sys.stderr.flush()
        print(f"simulator: host {agent.node}'s agent failed: {exc!r}", flush=True)
        os._exit(3)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="trainmover.bench.control_sim")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--store", required=True, help="HOST:PORT")
    p.add_argument("--spec", required=True, help="SimSpec as JSON")
    p.add_argument("--part", default="0/1", help="I/K: this process simulates the hosts "
                   "whose number is I modulo K (K processes share the hosts)")
    args = p.parse_args(argv)
    part, _, parts = args.part.partition("/")
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)     # never outlives the benchmark
    raise_open_files(1 << 20)
    spec = SimSpec(**json.loads(args.spec))
    cfg = jobfile.read_job(args.run_dir)
    run_key = jobfile.run_key(args.run_dir)
    host, _, port = args.store.rpartition(":")
    samples = Samples()
    full = set(range(cfg.hosts.nnodes) if spec.full_nodes is None else spec.full_nodes)
    agents = [(SimAgent if node in full else LightAgent)(args.run_dir, host, int(port), cfg,
                                                         node, spec, samples, run_key)
              for node in range(cfg.hosts.nnodes) if node % int(parts) == int(part)]
    _fatal_on_no_descriptors()
    jobs = [gevent.spawn(_serve, a) for a in agents]
    gevent.joinall(jobs)
    with open(f"{spec.samples_path}.{part}", "w") as f:
        json.dump({"rows": samples.rows,
                   "cpu_s": sum(os.times()[:2])}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
