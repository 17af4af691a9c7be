"""The job's agent: hosts the store and starts, watches and stops the job's processes, so
that the controller can die without taking training down with it.

Why a separate process: workers vote on every step through the store, so whoever hosts the
store is on the hot path and must be the simplest, longest-lived process of the job. The
agent makes no decisions; the controller (``coordinator.py``) sends it requests through the
store and reads back what happened:

- ``agent/<node>/req/<n>``: ``spawn`` (a worker or standby of this job, by name; the agent
  builds the command line of its own worker entry point, never one taken from the store),
  ``signal`` (KILL / TERM-then-KILL / STOP / CONT to one incarnation of a process),
  ``shutdown`` (stop everything and exit);
- ``agent/proc/<name>``: the current incarnation and PID of each process it started;
- ``agent/exit/<n>``: one record per process exit (name, incarnation, code, time).

Workers are the agent's children and die with it (``PR_SET_PDEATHSIG``); the agent is in its
own session, so it outlives the controller. When the controller's process disappears without
having shut the job down, the agent restarts it (``controller.restart="auto"``: ``trainmover
controller --resume``, at most ``controller.max_restarts`` times) or waits
``controller.grace_s`` for an operator to run that command, then stops the job
(``agent/failover.py``). Training continues meanwhile. The agent reads these settings, and
its own (``AgentConfig``), from the run dir's ``job.json``.

Processes are started before the agent imports torch, so the agent adds no start-up latency:
the store's listening socket is created by the controller and inherited (``--listen-fd``);
workers that connect early wait in its backlog.
"""
from __future__ import annotations

import argparse
import os
import select
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from trainmover.agent import forkserver, groupvote
from trainmover.agent.aborts import AbortRelay
from trainmover.agent.commands import CommandRelay
from trainmover.agent.beat import HostBeat
from trainmover.agent.failover import ControllerWatch
from trainmover.agent.feeds import FenceWatch, RequestFeed
from trainmover.agent.perfs import Perfs
from trainmover.agent.reports import Reports
from trainmover.agent.votes import Channels, VoteRelay, send_on
from trainmover.agent.snapshots import SnapshotServer
from trainmover.core import jobfile, kvproxy, kvserver, kvstore, rundir, storeaddr
from trainmover.core import protocol as P
from trainmover.core.auth import AuthStore, load_secret
from trainmover.core.config import JobConfig
from trainmover.core.events import EventLog
from trainmover.core.proc import PR_SET_PDEATHSIG, prctl, raise_open_files


# How often the agent reaps exited orphans re-parented to it (a dead worker's data loader
# processes): a zombie costs only a process-table entry until then.
ORPHAN_REAP_S = 1.0
# The agent's threads hand the interpreter over this often (Python's default: 5 ms). Its
# threads wait on I/O and relay small messages: the host's door to the store, the vote
# relay, the channels' reader, the commands. With the default, a request through the door
# waited up to 5 ms for the interpreter at each hop while another thread ran, which added
# ~25 ms to a planned migration's switch at 4 workers (benchmarks/results/
# door-4w-planned-switch.md); the agent's threads are never CPU-bound for long.
SWITCH_INTERVAL_S = 0.0005


def _die_with_parent() -> None:
    """In each child, before exec: ask Linux to SIGKILL it if the agent dies, so an agent
    killed without warning never leaves workers behind."""
    # not Linux: the workers' own store-liveness checks still end them
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)



class _NeverStarted:
    """The process of a spawn that failed (its program could not be run)."""

    pid = None
    returncode = 127

    def poll(self) -> int:
        return self.returncode

    def wait(self, timeout=None) -> int:
        return self.returncode

    def kill(self) -> None:
        pass

    def send_signal(self, sig) -> None:
        pass


@dataclass
class Child:
    name: str
    incarnation: int
    proc: subprocess.Popen | forkserver.ForkedProcess
    kill_at: float | None = None     # TERM was sent: KILL at this time if still alive
    reported: bool = False
    pidfd: int | None = None         # readable once the process exited (Linux >= 5.3)
    channel: socket.socket | None = None   # the agent's end of the process's channel
    beats: int = 0                   # beats it sent on it (worker/liveness.Heartbeat)
    beat_at: float = 0.0             # when the last of them came (time.monotonic)
    standby: bool = False

    def __post_init__(self) -> None:
        if self.proc.pid is not None and hasattr(os, "pidfd_open"):
            try:
                self.pidfd = os.pidfd_open(self.proc.pid)
            except OSError:
                pass   # an older kernel: exits are seen at the next poll instead

    def exit_wakes(self) -> bool:
        """Whether its exit wakes the agent's loop (its pidfd does), or must be polled."""
        return self.pidfd is not None


class Agent:
    """One host's agent. Host 0's hosts the store (``listen_fd``: the socket the controller
    opened) and restarts a dead controller; another host's connects to the store at
    ``host:port``, beats a heartbeat the controller watches, and stops its processes and
    exits when it finds its host declared lost (fenced) or the store gone."""

    def __init__(self, run_dir: str, store: str, cfg: JobConfig, node: int = 0,
                 address: str | None = None, listen_fd: int | None = None):
        self.run_dir = run_dir
        self.store_address, self.listen_fd = store, listen_fd   # HOST:PORT or etcd://...
        # the store on etcd outlives host 0: host 0 can then be fenced like any host, and
        # the agents after the controller's host take over from a silent controller
        self.etcd = storeaddr.is_etcd(store)
        self.node = node
        # this host's address: its workers' gloo binds (the built-in store's host by default)
        self.address = address or ("127.0.0.1" if self.etcd else store.rpartition(":")[0])
        self.cfg = cfg
        self.children: dict[str, Child] = {}
        self.events = EventLog(os.path.join(run_dir, "events.jsonl"),
                               worker="agent" if node == 0 else f"agent{node}")
        self.controller = ControllerWatch(run_dir, cfg, node, self.etcd, self.events)
        self.store = None
        self.store_server = None      # host 0's: the job's store (core/kvserver.py)
        # the host's door to the built-in store (core/kvproxy.py): its processes connect
        # there, and it holds one connection to the store for them all
        self.door: kvproxy.KVProxy | None = None
        self._door_sock: socket.socket | None = None
        self.process_store = store    # the store's address handed to its processes
        self._refused_reported, self._refusal_report_at = 0, 0.0
        self._requests: RequestFeed | None = None    # the controller's requests to this host
        self._fence: FenceWatch | None = None        # hosts but 0: declared lost?
        self._host_beat: HostBeat | None = None       # the host's heartbeat (a thread)
        self._relay: VoteRelay | None = None          # its processes' votes, relayed
        self._group: groupvote.GroupLeader | None = None   # its vote group's store, if leader
        self._channels: Channels | None = None        # its processes' channels, read
        self._aborts: AbortRelay | None = None        # its processes' abort watches
        self._commands: CommandRelay | None = None    # the controller's commands to them
        self.snapshots: SnapshotServer | None = None   # the peer-snapshot holder, if used
        self.hash_seed = jobfile.python_hash_seed(load_secret(run_dir))
        self.forks: forkserver.ForkServer | None = None   # agent.fork_server, once started
        self._subreaper = False      # orphans of its descendants are its children to reap
        self._reap_at = 0.0

    # --- processes ---------------------------------------------------------------------------
    def spawn(self, req: P.AgentSpawn) -> None:
        name, incarnation = req.name, req.incarnation
        old = self.children.get(name)
        if old is not None and old.incarnation >= incarnation:
            return  # a request replayed by a resumed controller: already done
        if old is not None and old.proc.poll() is None:
            self._kill(old)  # never two incarnations of one name
        args = ["--run-dir", self.run_dir, "--name", name, "--store", self.process_store,
                *req.worker_args()]
        # the process's own channel to this agent (its beats and votes): nobody else can
        # write it
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        mine.setblocking(False)
        try:
            env = self._env(req)
            log_fd = rundir.open_file(os.path.join(self.run_dir, "logs", f"{name}.log"),
                                      os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            with os.fdopen(log_fd, "ab") as log:
                proc = self._forked(args, env, log.fileno(), name, theirs.fileno())
                if proc is None:
                    env[P.AGENT_CHANNEL_ENV] = str(theirs.fileno())
                    proc = subprocess.Popen([sys.executable, "-m", "trainmover.worker", *args],
                                            stdout=log, stderr=subprocess.STDOUT, env=env,
                                            pass_fds=(theirs.fileno(),),
                                            preexec_fn=_die_with_parent)
        except (OSError, ValueError) as exc:       # ValueError: a log path refused
            # the controller sees an incarnation that exited at once (code 127, as a shell
            # reports a command it cannot run) and handles it like any other exit
            mine.close()
            self.events.emit("spawn_failed", name=name, incarnation=incarnation,
                             error=str(exc), level="error")
            self.children[name] = Child(name, incarnation, _NeverStarted())
            return
        finally:
            theirs.close()
        self.children[name] = child = Child(name, incarnation, proc, channel=mine)
        self._track(child, req.standby)
        if self.store is not None:
            self.store.set(P.agent_proc_key(name),
                           P.write_message(P.ProcRecord(proc.pid, incarnation)))
        self.events.emit("process_started", name=name, pid=proc.pid, incarnation=incarnation,
                         standby=req.standby,
                         forked=isinstance(proc, forkserver.ForkedProcess))

    def deliver(self, name: str, message: bytes) -> str:
        """A command (``agent/commands.py``) onto the channel of the process ``name``."""
        child = self.children.get(name)
        if child is None:
            return "unknown"
        if child.reported:
            return "gone"
        went = send_on(child, message)
        if went == "too big":
            self.events.emit("message_rejected", key=f"command to {name}",
                             error=f"{len(message)} bytes: past the channel's limit",
                             level="error")
            return "gone"
        return went

    def _track(self, child: Child, standby: bool) -> None:
        """Read the process's channel; a worker's votes are expected from its first step."""
        child.standby = standby
        if self._channels is None:
            return                      # before the store is up: ``serve`` does it
        self._channels.add(child)
        if not standby:
            self._relay.expect(child.name)

    def _forked(self, args: list[str], env: dict, log_fd: int, name: str, channel_fd: int):
        """The worker, forked by the fork server (``agent.fork_server``), or None: off, or
        the server failed (reported once; every later process starts anew)."""
        if self.forks is None:
            return None
        try:
            first = self.forks.import_s is None
            proc = self.forks.spawn(args, env, log_fd, name, channel_fd)
            if first:
                # what a worker started anew pays before it runs (a restart's estimate)
                self.events.emit("fork_server_ready", pid=self.forks.proc.pid,
                                 import_s=self.forks.import_s)
            return proc
        except forkserver.ForkServerError as exc:
            self.forks = None
            self.events.emit("fork_server_failed", error=str(exc)[:2000], level="warning")
            return None

    def _start_fork_server(self) -> None:
        if not self.cfg.agent.fork_server:
            return
        self._subreaper = forkserver.become_subreaper()
        if not self._subreaper:
            self.events.emit("fork_server_failed", error="no PR_SET_CHILD_SUBREAPER here",
                             level="warning")
            return
        try:
            self.forks = forkserver.ForkServer(
                self._base_env(), os.path.join(self.run_dir, "logs", "forkserver.log"),
                self.cfg.agent.fork_server_timeout_s, preexec_fn=_die_with_parent)
        except OSError as exc:
            self.events.emit("fork_server_failed", error=str(exc), level="warning")
            return
        self.events.emit("fork_server_started", pid=self.forks.proc.pid)

    def _base_env(self) -> dict:
        """What every process of this host gets (the fork server too: the hash seed is an
        interpreter's from its start)."""
        env = dict(os.environ, PYTHONUNBUFFERED="1", TRAINMOVER_GLOO_HOST=self.address,
                   TRAINMOVER_NODE=str(self.node),
                   OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS",
                                                  str(self.cfg.threads_per_worker())))
        if "PYTHONHASHSEED" not in os.environ:     # a user's own choice stands
            env["PYTHONHASHSEED"] = self.hash_seed
        return env

    def _env(self, req: P.AgentSpawn) -> dict:
        cfg = self.cfg
        env = self._base_env()
        if req.gpu is not None:
            env["LOCAL_RANK"] = str(req.gpu)
            if cfg.process.deterministic:
                env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"   # cuBLAS's deterministic mode
        if cfg.process.isolate_caches:
            # one "machine" per process: its own compiler caches, kept across its restarts
            root = os.path.join(self.run_dir, "cache", req.name)
            env.update(TORCHINDUCTOR_CACHE_DIR=os.path.join(root, "inductor"),
                       TRITON_CACHE_DIR=os.path.join(root, "triton"),
                       TMPDIR=os.path.join(root, "tmp"))
            os.makedirs(env["TMPDIR"], exist_ok=True)
        return env

    def _kill(self, child: Child) -> None:
        if child.proc.poll() is None:
            child.proc.kill()
        child.proc.wait()
        self._reap(child)

    def signal(self, req: P.AgentSignal) -> None:
        child = self.children.get(req.name)
        if child is None or child.incarnation != req.incarnation:
            return  # that incarnation is gone already
        sig = req.signal
        if sig == "KILL":
            self._kill(child)   # synchronous, so requests after it see the process gone
        elif child.proc.poll() is None:
            if sig == "TERM":
                child.proc.send_signal(signal.SIGTERM)
                child.kill_at = time.monotonic() + req.grace_s
            else:
                child.proc.send_signal(getattr(signal, f"SIG{sig}"))

    def _reap(self, child: Child) -> None:
        code = child.proc.poll()
        if code is None or child.reported:
            return
        child.reported = True
        if child.pidfd is not None:
            os.close(child.pidfd)
            child.pidfd = None
        if child.channel is not None:
            if self._channels is not None:
                self._channels.remove(child)      # closed by the channels' reader
                self._relay.forget(child.name)
                self._aborts.forget(child.name)
            else:
                child.channel.close()
        record = P.ExitRecord(child.name, child.incarnation, code, time.time())
        index = self.store.add(P.AGENT_EXIT_COUNT_KEY, 1)
        self.store.set(P.agent_exit_key(index), P.write_message(record))
        self.events.emit("process_exited", name=child.name, incarnation=child.incarnation,
                         code=code)

    def stop_all(self, grace_s: float) -> None:
        for c in self.children.values():
            if c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for c in self.children.values():
            try:
                c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()
            self._reap(c)

    # --- the controller ----------------------------------------------------------------------
    def _watch(self, now: float) -> str | None:
        """Why this agent must stop (None: it goes on)."""
        for part in (self._host_beat, self._relay, self._aborts, self._commands,
                     self._reports):
            if part.error is not None:
                raise part.error
        if self.door is not None and (self.door.upstream_error is not None or
                                      not self.door.serving()):
            raise kvstore.StoreClosed(f"the host's door to the store is closed: "
                                      f"{self.door.upstream_error or 'its thread failed'}")
        if self.node == 0 and not self.etcd:
            return None if self.controller.alive(now) else "no controller"
        # the controller's signed word, not the key's mere existence (agent/feeds.py)
        if self._fence.fenced.is_set():
            return "fenced"
        if self._fence.error is not None:
            raise self._fence.error
        if self.etcd:
            return None if self.controller.alive(now) else "no controller"
        return None

    # --- the loop ----------------------------------------------------------------------------
    def serve(self, initial: list[P.AgentSpawn]) -> int:
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        if not self.etcd and self.cfg.comm.store_proxy:
            # listening before any process starts (their connections wait in the backlog
            # until the door opens, once the store is up)
            self._door_sock = socket.create_server(("127.0.0.1", 0), backlog=1024)
            self.process_store = f"127.0.0.1:{self._door_sock.getsockname()[1]}"
        self._start_fork_server()
        if self.forks is None:
            for req in initial:      # at once, before the store is up
                self.spawn(req)
            initial = []
        # (else they are forked once the store is up: the fork server imports torch meanwhile)
        run_key = jobfile.run_key(self.run_dir)
        if self.listen_fd is not None:
            # a few connections a worker: a soft limit of 1024 descriptors would refuse the
            # workers of a job past ~250 of them
            raise_open_files()
            # served from a thread of this process for the job's lifetime (torch-free: the
            # store is up before the fork server has imported torch)
            self.store_server = kvserver.serve(run_key, listen_fd=self.listen_fd,
                                              limits=kvstore.StoreLimits.of(self.cfg.comm))

        if self._door_sock is not None:
            host, _, port = self.store_address.rpartition(":")
            key = kvstore.store_key(run_key)
            self.door = kvproxy.KVProxy(
                key, self._door_sock,
                kvstore.connect_socket(host, int(port), key, self.cfg.comm.store_timeout_s),
                kvstore.StoreLimits.of(self.cfg.comm))

        def client(direct: bool = False) -> AuthStore:
            # through the host's door too: the agent's threads that block on the store (a
            # client each) are streams of the door's one connection; but for the vote
            # relay's, on every step's path, where the door's hop would add ~0.1 ms a
            # request (benchmarks/door_cost.py)
            return AuthStore(storeaddr.connect(
                self.store_address if direct else self.process_store, run_key,
                self.cfg.comm.store_timeout_s), run_key)

        self.store = client()
        self.controller.store = self.store      # read in this loop's thread only
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._requests = RequestFeed(
            client(), self.node, self.cfg.agent.request_recheck_s, self._wake,
            on_reject=lambda key, why: self.events.emit("message_rejected", key=key,
                                                        error=why, level="error"))
        # host 0's agent serves the built-in store: it is never declared lost
        self._fence = FenceWatch(client(), self.node, self._wake) \
            if self.node or self.etcd else None
        # its processes' step measurements, one key a host (agent/perfs.py), written by the
        # beat thread before the beat that announces them
        self._perfs = Perfs(on_reject=lambda name, why: self.events.emit(
            "message_rejected", key=f"channel of {name}", error=why, level="error"))
        self._host_beat = HostBeat(client(), self.node,
                                   self.cfg.health.host_beat_interval_s(self.cfg.hosts.nnodes),
                                   self.cfg.health.quiet_listed_s(),
                                   lambda: list(self.children.values()), self._perfs)
        # its processes' votes, relayed as one ballot a host (agent/votes.py), and the
        # reader of their channels (beats and votes)
        self._relay = self._vote_relay(client, run_key)
        # its processes' watches of the controller's aborts, one a host (agent/aborts.py)
        self._aborts = AbortRelay(client)
        # the controller's commands to its processes, relayed on their channels
        # (agent/commands.py)
        self._commands = CommandRelay(
            client(), self.node, self.deliver,
            on_reject=lambda key, why: self.events.emit("message_rejected", key=key,
                                                        error=why, level="error"))
        # its processes' failure reports, one value a host and epoch, and their notes of a
        # recovery done, one add a host (agent/reports.py)
        self._reports = Reports(
            client(), self.node, self.cfg.agent.vote_coalesce_s,
            # (the exits the loop has seen: a process is reaped by the loop's thread only)
            lambda: {c.name for c in list(self.children.values())
                     if not c.standby and c.proc.returncode is None},
            on_reject=lambda name, why: self.events.emit(
                "message_rejected", key=f"channel of {name}", error=why, level="error"),
            silent_after_s=self.cfg.recovery.report_timeout_s)
        self._aborts.on_fired = self._reports.aborted
        self._channels = Channels(self._relay.vote, self._aborts.watch,
                                  lambda child, raw: self._perfs.received(child.name, raw),
                                  lambda child, epoch, raw: self._reports.received(
                                      child.name, epoch, raw),
                                  lambda child, rid: self._reports.recovered(
                                      child.name, rid))
        for c in self.children.values():
            if c.channel is not None:
                self._track(c, c.standby)
        for c in self.children.values():
            if c.proc.pid is None:
                continue
            self.store.set(P.agent_proc_key(c.name),
                           P.write_message(P.ProcRecord(c.proc.pid, c.incarnation)))
        for req in initial:
            self.spawn(req)
        if self.cfg.takes_snapshots():
            self.snapshots = SnapshotServer(
                self.address, jobfile.run_key(self.run_dir), self.cfg.snapshot.keep,
                self.cfg.snapshot.io_timeout_s,
                on_error=lambda why: self.events.emit("snapshot_request_refused", error=why,
                                                      level="warning")).start()
            self.store.set(P.agent_key(self.node, "snapshots"), self.snapshots.address)
        self.store.set(P.agent_key(self.node, "info"),
                       P.write_message(P.AgentInfo(os.getpid(), self.node, self.address)))
        self.events.emit("agent_started", node=self.node, address=self.address, pid=os.getpid(),
                         snapshots=self.snapshots.address if self.snapshots else None,
                         door=self.process_store if self.door is not None else None)
        try:
            return self._loop()
        except Exception as exc:  # noqa: BLE001 - a lost store ends every host but host 0
            if self.listen_fd is not None:
                raise
            self.stop_all(0.0)
            self.events.emit("agent_stopped", node=self.node, reason=f"store lost: {exc}",
                             level="error")
            return 1

    def _vote_relay(self, client, run_key: bytes) -> VoteRelay:
        """The host's vote relay, in its vote group (``agent/groupvote.py``) where the job
        has groups: their leaders serve a store for their members."""
        nnodes, cfg = self.cfg.hosts.nnodes, self.cfg
        size = cfg.agent.vote_group_size(nnodes, self.etcd)
        relay = VoteRelay(client(direct=True), client(direct=True), self.node,
                          cfg.layout.num_roles, cfg.agent.vote_coalesce_s,
                          hosts=-(-nnodes // size), root_index=self.node // size)
        members = groupvote.group_of(self.node, nnodes, size)
        leader = members[-1]
        if len(members) == 1:
            return relay
        if self.node == leader:
            try:
                self._group = groupvote.GroupLeader(run_key, self.address, self.node, members,
                                                    relay, kvstore.StoreLimits.of(cfg.comm),
                                                    cfg.comm.store_timeout_s)
            except (OSError, kvstore.StoreError) as exc:
                # its members vote at the job's store until an address is published (never)
                self.events.emit("vote_group_failed", node=self.node, error=str(exc),
                                 level="warning")
                return relay
            self.store.set(P.agent_key(self.node, "votes"), self._group.address)
            self.events.emit("vote_group_serving", node=self.node, address=self._group.address,
                             members=[n for n in members if n != self.node])
            return relay
        relay.on_left_group = lambda why: self.events.emit(
            "vote_group_left", node=self.node, leader=leader, why=why, level="warning")
        relay.group = groupvote.GroupLink(run_key, leader, client(),
                                          cfg.agent.vote_group_timeout_s, relay.leave_group)
        return relay

    def _loop(self) -> int:
        while True:
            # read from the store as they come (agent/feeds.py): a forged value at the head
            # is not consumed, and a hole (an index the counter handed out, never written)
            # is skipped
            if self._requests.error is not None:
                raise self._requests.error
            for req in self._requests.poll():
                if isinstance(req, P.AgentSpawn):
                    self.spawn(req)
                elif isinstance(req, P.AgentSignal):
                    self.signal(req)
                elif isinstance(req, P.AgentShutdown):
                    return self._shutdown(req.grace_s, "requested")
            now = time.monotonic()
            for c in list(self.children.values()):
                if c.kill_at is not None and now > c.kill_at and c.proc.poll() is None:
                    c.proc.kill()
                self._reap(c)
            if self._subreaper and now >= self._reap_at:
                self._reap_at = now + ORPHAN_REAP_S
                forkserver.reap_orphans(self._own_pids())
            self._report_refusals(now)
            why = self._watch(time.time())
            if why == "fenced":
                # declared lost (its link was down, say): its processes hold stale state and
                # must not rejoin; the job already replaced them
                self.stop_all(0.0)
                self.events.emit("agent_stopped", node=self.node, reason=why)
                return 0
            if why is not None:
                return self._shutdown(self.cfg.controller.stop_grace_s, why)
            self._wait(self._idle_for(time.monotonic()))

    def _idle_for(self, now: float) -> float:
        """How long the loop may sleep: until the nearest timer it keeps (a TERM's KILL
        deadline, the orphans' reaping, the controller's check), ``agent.idle_wake_s`` at
        most, ``agent.poll_s`` at least (and while a process's exit cannot wake it)."""
        cfg = self.cfg.agent
        wait = cfg.idle_wake_s
        for c in self.children.values():
            if c.reported:
                continue
            if c.kill_at is not None:
                wait = min(wait, c.kill_at - now)
            if not c.exit_wakes():
                wait = min(wait, cfg.poll_s)
        if self._subreaper:
            wait = min(wait, self._reap_at - now)
        if self._watches_controller():
            wait = min(wait, self.controller.next_check_in(time.time()))
        return max(cfg.poll_s, wait)

    def _watches_controller(self) -> bool:
        """Whether ``_watch`` asks the controller's watch (host 0's agent, or any with the
        store on etcd)."""
        return self.etcd or self.node == 0

    def _report_refusals(self, now: float) -> None:
        """An event when the store or the host's door hung up on connections that did not
        prove the run's key (someone at the port), rate-limited: a flood of them costs one
        line per interval."""
        refused = sum(s.refused for s in (self.store_server, self.door) if s is not None)
        if refused == self._refused_reported or now < self._refusal_report_at:
            return
        self._refused_reported = refused
        self._refusal_report_at = now + self.cfg.agent.refusal_report_s
        self.events.emit("store_connections_refused", count=refused, level="warning")

    def _own_pids(self) -> set[int]:
        """The processes whose exit codes this agent reads (the rest are orphans to reap)."""
        pids = {c.proc.pid for c in self.children.values() if c.proc.pid is not None}
        pids.update(p.pid for p in self.controller.controllers)
        if self.forks is not None:
            pids.add(self.forks.proc.pid)
        return pids

    def _wake(self) -> None:
        """A request or the fencing came (from a feed's thread): the loop looks at once."""
        try:
            os.write(self._wake_w, b"!")
        except BlockingIOError:
            pass                       # woken already

    def _wait(self, timeout_s: float) -> None:
        """Sleep until ``timeout_s`` passed, a child exited or a feed woke the loop,
        whichever comes first."""
        # poll, not select: host 0's agent serves the store, and its descriptors pass
        # select's limit of 1024 with a few hundred workers
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        for c in self.children.values():
            if c.pidfd is not None:
                poller.register(c.pidfd, select.POLLIN)
        ready = {fd for fd, _ in poller.poll(timeout_s * 1000)}
        if self._wake_r in ready:
            try:
                os.read(self._wake_r, 4096)
            except BlockingIOError:
                pass

    def _shutdown(self, grace_s: float, why: str) -> int:
        self.stop_all(grace_s)
        if self.forks is not None:
            self.forks.close()
            self.forks = None
        served = {} if self.store_server is None else \
            {"store_requests": self.store_server.requests}    # the job's whole store load
        self.events.emit("agent_stopped", node=self.node, reason=why, **served)
        self.store.set(P.agent_key(self.node, "done"), why)
        if self.listen_fd is None:
            return 0
        # the controller reads "done" before the store goes away with this process
        deadline = time.monotonic() + self.cfg.agent.shutdown_ack_s
        ack = P.agent_key(self.node, "done_ack")
        while time.monotonic() < deadline and not self.store.check([ack]):
            time.sleep(self.cfg.agent.poll_s)
        return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="trainmover.agent")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--store", required=True, help="HOST:PORT or etcd://...")
    p.add_argument("--listen-fd", type=int,
                   help="the built-in store's socket, to serve (none: the store is etcd)")
    p.add_argument("--address", help="this host's address, which its processes bind "
                                     "(default: the built-in store's host)")
    p.add_argument("--initial", required=True, help="JSON file of the first spawn requests")
    p.add_argument("--controller-pid", type=int, required=True)
    args = p.parse_args(argv)
    with open(args.initial) as f:
        initial = [P.decode_agent_request(line) for line in f if line.strip()]
    cfg = jobfile.read_job(args.run_dir)
    agent = Agent(args.run_dir, args.store, cfg, address=args.address,
                  listen_fd=args.listen_fd)
    agent.controller.current = P.ControllerInfo(args.controller_pid, 0)
    return agent.serve(initial)


def serve_host(run_dir: str, endpoint: str, node: int, address: str | None,
               connect_timeout_s: float, expect: dict | None = None) -> int:
    """``trainmover agent``: serve host ``node`` of the job in ``run_dir`` (a shared
    filesystem), whose store is at ``endpoint`` (HOST:PORT; default: the run dir's
    control.json, waited for up to ``connect_timeout_s``)."""
    control = os.path.join(run_dir, "control.json")
    deadline = time.monotonic() + connect_timeout_s
    while not endpoint:
        if os.path.exists(control):
            endpoint = jobfile.read_control(run_dir)["store"]
        elif time.monotonic() > deadline:
            raise ValueError(f"no job started in {run_dir!r} within {connect_timeout_s} s "
                             f"(no control.json): pass --rdzv-endpoint HOST:PORT")
        else:
            time.sleep(0.1)
    while not os.path.exists(os.path.join(run_dir, "job.json")):
        if time.monotonic() > deadline:
            raise ValueError(f"{run_dir!r} holds no job (no job.json): is it the run dir the "
                             f"controller was given, on a filesystem every host shares?")
        time.sleep(0.1)
    cfg = jobfile.read_job(run_dir)
    if not 0 < node < cfg.hosts.nnodes:
        raise ValueError(f"--node-rank {node}: the job has hosts 0..{cfg.hosts.nnodes - 1}, "
                         f"and host 0's agent is the controller's")
    actual = {"nnodes": cfg.hosts.nnodes,
              "nproc_per_node": cfg.hosts.per_node(cfg.layout.num_roles)}
    for key, value in (expect or {}).items():
        if value is not None and value != actual[key]:
            raise ValueError(f"--{key.replace('_', '-')} {value} does not match the job's "
                             f"{actual[key]} (job.json)")
    agent = Agent(run_dir, endpoint, cfg, node=node, address=address)
    return agent.serve([])
