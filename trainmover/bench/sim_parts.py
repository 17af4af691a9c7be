"""The pieces of ``bench control``'s simulated hosts that a full worker and a light one
share (``bench/control_sim.py``): the simulation's settings, a simulated process and its
store clients, the overhead samples, and a survivor's or joiner's store traffic in a
recovery. Imported by ``control_sim`` after gevent's monkey-patching."""
from __future__ import annotations

import os
import signal
import sys
import threading
import traceback
from dataclasses import dataclass, field
from types import SimpleNamespace

import gevent

from trainmover.agent.main import Child
from trainmover.comm.groups import AbortSignal
from trainmover.core import kvstore
from trainmover.core import protocol as P
from trainmover.core.auth import AuthStore

@dataclass
class SimSpec:
    """The simulation's own settings (the job's are its job.json)."""

    compute_s: float                                   # a step's simulated compute
    crashes: dict[str, int] = field(default_factory=dict)   # worker -> step it crashes at
    samples_path: str = ""                             # where the overheads are written
    full_nodes: list[int] | None = None                # hosts simulated whole (None: all)


class SimStores:
    """What the worker classes take as ``stores`` (``comm.groups.StoreClients``): one
    authenticated client per greenlet, as a worker has one per thread; or (``shared``, a
    light worker's, whose store traffic runs in one greenlet at a time) one client for the
    worker's life, as a worker's main thread keeps its client: a light host's workers then
    hold a connection each, not one per greenlet of a recovery (at 8K workers that was
    past the store's descriptor limit here)."""

    def __init__(self, host: str, port: int, run_key: bytes, timeout_s: float,
                 shared: bool = False):
        self.host, self.port, self.run_key, self.timeout_s = host, port, run_key, timeout_s
        self.on_reject = None
        self.closed = False
        self.shared = shared
        self._local = threading.local() if not shared else SimpleNamespace(store=None)
        self._clients: list[kvstore.KVClient] = []

    def get(self) -> AuthStore:
        store = getattr(self._local, "store", None)
        if store is None:
            if self.closed:
                raise kvstore.StoreClosed("the simulated process was killed")
            raw = kvstore.connect(self.host, self.port, self.run_key, self.timeout_s)
            self._clients.append(raw)
            store = self._local.store = AuthStore(raw, self.run_key)
        return store

    def release(self) -> None:
        """The calling greenlet is done with its client: closed and forgotten, so that a
        short-lived greenlet of a recovery holds no descriptor after it (a shared client is
        kept)."""
        if not self.shared:
            self.reset()

    def reset(self) -> None:
        """The calling greenlet's client is closed and forgotten (a greenlet killed in the
        middle of a request leaves its connection out of step)."""
        store = getattr(self._local, "store", None)
        if store is not None:
            self._local.store = None
            store.raw.close()
            self._clients.remove(store.raw)

    def close(self) -> None:
        """The process is gone: its connections close (its peers see them go)."""
        self.closed = True
        for client in self._clients:
            client.close()


class Crash(Exception):
    """A simulated worker dies here (SIGKILL's exit code)."""


class SimProcess:
    """A simulated worker as its agent sees a process (``subprocess.Popen``'s methods)."""

    def __init__(self, worker):
        self.pid = os.getpid()       # heartbeats are keyed by it, as a process's by its own
        self.returncode: int | None = None
        self.worker = worker

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout=None) -> int | None:
        return self.returncode

    def exit(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
            self.worker.stores.close()
            if self.worker.channel is not None:
                self.worker.channel.close()
            self.worker.agent._wake()      # as a process's pidfd wakes its agent

    def kill(self) -> None:
        if self.returncode is None:
            # a fence (a run's end signals its processes instead: ``send_signal``): where
            # the worker was, in the simulator's log, to tell one that was slow from one
            # whose control path stalled
            frame = self.worker.greenlet.gr_frame
            if frame is not None:
                stack = "".join(traceback.format_stack(frame)[-8:])
                print(f"simulator: {self.worker.name} killed at:\n{stack}", file=sys.stderr,
                      flush=True)
            self.worker.greenlet.kill(block=False)
            self.exit(-signal.SIGKILL)

    def send_signal(self, sig) -> None:
        if sig in (signal.SIGTERM, signal.SIGKILL) and self.returncode is None:
            self.worker.greenlet.kill(block=False)
            self.exit(-sig)
        # SIGSTOP/SIGCONT: not simulated (a hang is a later addition)


class SimChild(Child):
    def __post_init__(self) -> None:
        self.pidfd = None            # no process to watch: its exit wakes the agent itself

    def exit_wakes(self) -> bool:
        return True


class Samples:
    """The workers' per-step records: (worker, epoch, step, time, overhead_s, vote_s)."""

    def __init__(self):
        self.rows: list[tuple] = []

    def add(self, *row) -> None:
        self.rows.append(row)


NCCL_ID_BYTES = 128          # a NCCL communicator's unique id (ncclUniqueId)

# how often a survivor's recovery looks at its plan's abort (worker/recover.py polls a
# group build's every millisecond; thousands of simulated workers share one process here)
ABORT_POLL_S = 0.05


class _Recovers:
    """A survivor's and a joiner's store traffic in a recovery (``worker/recover.py``):
    report, wait for the plan, rebuild the groups it names, send or take state, resume."""

    def _groups(self) -> dict[str, int]:
        """Each of this role's groups of more than one member -> its rank in it."""
        return {spec.name: spec.members.index(self.role)
                for spec in self.layout.groups_of(self.role).values() if spec.size > 1}

    def _report(self, step: int) -> None:
        accounting = {name: {"coll": self.collectives, "sent": 0, "recv": 0, "pending": 0,
                             "generation": self.generations.get(name, 0)}
                      for name in self._groups()}
        # to its agent, as a worker sends it on its channel (agent/reports.py)
        self._send_report(self.epoch, P.FailureReport(step, "aborted", False, accounting))

    def _recover(self) -> None:
        self._report(self.step)
        while True:
            cmd = self.commands.next()
            if not isinstance(cmd, P.Recover):
                continue
            # as worker/recover.survive: the plan's waits end when the controller abandons
            # it (aborts its epoch); the survivor reports again in that epoch and waits for
            # the next plan
            abort = self._plan_abort(cmd.epoch)
            work = gevent.spawn(self._carry_out, cmd)
            while not work.ready() and not abort.wait(ABORT_POLL_S):
                pass
            if work.ready() and work.successful():
                break
            if not work.ready():
                work.kill()            # aborted in the middle (killed counts as successful)
            elif not abort.is_set():
                work.get()             # a failure of its own: raised
            self.epoch = cmd.epoch
            self._report(cmd.resume_step)
        self._send_recovered(cmd.recovery_id)
        self.epoch, self.step = cmd.epoch, cmd.resume_step

    def _plan_abort(self, epoch: int) -> AbortSignal:
        """The signal of ``epoch``'s abort, watched as a worker watches it (through its
        agent)."""
        abort = AbortSignal()
        self.inbox.watch_abort(abort, epoch)
        return abort

    def _carry_out(self, cmd: P.Recover) -> None:
        try:
            self._rebuild(cmd.groups)
            for send in cmd.send_states or []:
                self._rendezvous(send.transfer_group, send.transfer_generation, 0, 2)
        except gevent.GreenletExit:
            self.stores.reset()        # killed (an abort) maybe in a request
            raise
        finally:
            self.stores.release()

    def _rebuild(self, groups: dict[str, int]) -> None:
        for name, generation in sorted(groups.items()):
            spec = self.layout.group(name)
            self._rendezvous(name, generation, spec.members.index(self.role), spec.size)
            self.generations[name] = generation
        self.collectives = 0

    def own_stores(self) -> SimStores:
        """Store clients of this worker's own, apart from its main ones (a helper
        thread's)."""
        return SimStores(*self.agent.endpoint(), self.agent.run_key,
                         self.cfg.comm.group_timeout_s)

    def _rendezvous(self, group: str, generation: int, rank: int, size: int,
                    raw=None) -> None:
        """A group build's store traffic, as the job's backend makes it
        (``benchmarks/rendezvous_cost.py``): gloo's full mesh, this member's addresses in
        (one a peer) and every member's out; with ``comm.backend`` "nccl", the unique id,
        set by rank 0 and read by the others (NCCL's own bootstrap then runs outside the
        store: not simulated)."""
        raw = raw if raw is not None else self.stores.get().raw
        timeout = self.cfg.comm.group_timeout_s
        if self.cfg.comm.backend == "nccl":
            key = P.nccl_id_key(group, generation)
            if rank == 0:
                raw.set(key, b"i" * NCCL_ID_BYTES)
            else:
                raw.get(key, timeout=timeout)
            return
        keys = P.rendezvous_keys(group, generation, size)
        raw.set(keys[rank], b"a" * (154 + 8 * size))
        raw.multi_get(keys, timeout=timeout)

    def _perf(self) -> None:
        """The straggler detector's measurements, as a worker sends them to its agent
        every window."""
        step_s, window = self.agent.spec.compute_s, self.cfg.straggler.window
        self._send_perf(P.perf_message(P.StepPerf(
            self.role.name, self.step - window, self.step - 1, 0, step_s, step_s,
            {"dp": 0.0}, recent=[P.PerfWindow(self.step - window, self.step - 1, step_s)])))
