"""``trainmover bench control``: the control plane at thousands of workers, measured on the
code that runs in jobs.

One run per size N: the job's real store (``core/kvserver.py``, in its own process as a
job's is in host 0's agent), the real controller (``control/coordinator.py``, here in a
thread, its agent and process starts replaced: ``SimCoordinator``), and N/8 simulated hosts
of 8 workers each (``bench/control_sim.py``: real agents and real worker control code, the
compute and tensors stood in for). The job trains ``steady`` steps, then a worker crashes
and is recovered from a data-parallel replica onto a standby, then trains on; ``after``
steps later a worker of host 1 is migrated onto the other standby (asked for as
`trainmover migrate` asks), and the run ends once that migration is accounted.

Reported per size: the per-step control overhead (a step's time less its compute, every
worker's steady steps: p50, p99), the root store's requests per second and CPU share, the
controller's supervision round (p50, p99, max) and CPU share, the crash's control time
(from the fault to the recovery plan, and to the first step committed after it less that
step's compute), the migration's control time (its downtime as the controller accounts
it: with no state to move and no real group to build, what its protocol costs the stayers
at the switch; and from the request to the go and to done), and the simulator's own CPU
share: where it nears one core, the figures are the simulator's limit, not the control
plane's.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from trainmover.bench.report import git_commit, machine_description, write_result
from trainmover.control import collector
from trainmover.control.coordinator import Coordinator
from trainmover.core import decisions as C
from trainmover.core import jobfile, rundir
from trainmover.core import protocol as P
from trainmover.core.auth import create_secret
from trainmover.core.config import JobConfig
from trainmover.core.config_file import apply_overrides
from trainmover.core.events import EventLog, read_jsonl
from trainmover.core.proc import raise_open_files
from trainmover.core.topology import Layout, reporter_role
from trainmover.control.context import worker_names

WORKERS_PER_HOST = 8
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def layout_for(workers: int) -> Layout:
    """DP x PP8 x TP8 from 128 workers on (TP inside a host of 8), smaller below."""
    if workers % WORKERS_PER_HOST or workers < 2 * WORKERS_PER_HOST:
        raise ValueError(f"--workers {workers}: a multiple of {WORKERS_PER_HOST}, at least "
                         f"{2 * WORKERS_PER_HOST} (two data-parallel replicas of a host)")
    pp = min(8, workers // (2 * WORKERS_PER_HOST))
    while workers % (pp * WORKERS_PER_HOST):
        pp -= 1
    return Layout(dp=workers // (pp * WORKERS_PER_HOST), pp=pp, tp=WORKERS_PER_HOST)


def parse_sizes(text: str) -> list[int]:
    """``--workers``: checked before anything starts (a bad size names itself)."""
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--workers {text!r}: a comma list of integers") from None
    if not sizes:
        raise ValueError("--workers: no size given")
    for n in sizes:
        layout_for(n)
    return sizes


def sim_config(workers: int, standbys: int,
               overrides: list[tuple[str, str | None]] = ()) -> JobConfig:
    """A job of ``workers`` on hosts of 8, its settings the defaults but for what the
    simulation needs: no checkpoints or snapshots (nothing to write), no fork server (no
    processes), steps without end (the benchmark stops the job); then ``overrides``
    (``--section.field=value`` of the command line, recorded in the result)."""
    cfg = JobConfig(name=f"control-{workers}", layout=layout_for(workers))
    cfg.hosts.nnodes = workers // WORKERS_PER_HOST
    cfg.hosts.nproc_per_node = WORKERS_PER_HOST
    cfg.standby.count = standbys
    cfg.train.steps = 10 ** 9
    cfg.checkpoint.every = 0
    cfg.snapshot.every = 0
    cfg.agent.fork_server = False
    apply_overrides(cfg, list(overrides))
    # the sections changed (the whole job's checks refuse what a simulation is: many hosts
    # on loopback)
    for section in {key.replace("-", "_").partition(".")[0] for key, _ in overrides}:
        try:
            getattr(getattr(cfg, section), "validate", lambda: None)()
        except ValueError as exc:
            raise ValueError(f"--{section}.*: {exc}") from None
    return cfg


class SimCoordinator(Coordinator):
    """The job's controller, unchanged but for its start: the store is served by its own
    process, and the hosts' agents are the simulator's (every host's first processes are
    queued in the store, as a job's hosts other than 0 find theirs). Each supervision
    round (``_poll`` and the ``_flush`` after it) is timed, with the thread's CPU time."""

    def __init__(self, cfg: JobConfig, run_dir: str, spec: dict, timeout_s: float,
                 sim_procs: int = 1):
        super().__init__(cfg, run_dir, quiet=True, timeout_s=timeout_s)
        self.spec, self.sim_procs = spec, sim_procs
        self.sims: list[subprocess.Popen] = []
        self.rounds: list[list[float]] = []     # [start (epoch s), wall_s, cpu_s]
        self.store_proc: subprocess.Popen | None = None
        self._sim_failed = False
        self.store_stats = os.path.join(run_dir + ".store", "stats.txt")

    def _prepare(self) -> None:
        ctx, cfg = self.ctx, self.cfg
        rundir.create(self.run_dir)
        os.makedirs(os.path.join(self.run_dir, "logs"))
        self._secret = create_secret(self.run_dir)
        jobfile.write_job(self.run_dir, cfg, self._secret)
        self._run_key = jobfile.start_run(self.run_dir, self._secret)
        ctx.events = EventLog(os.path.join(self.run_dir, "events.jsonl"), worker="coordinator")
        listener = socket.create_server(("127.0.0.1", 0), backlog=4096)
        ctx.store_addr = f"127.0.0.1:{listener.getsockname()[1]}"
        os.makedirs(os.path.dirname(self.store_stats), exist_ok=True)
        self.store_proc = subprocess.Popen(
            [sys.executable, "-m", "trainmover.bench.control_store", "--run-dir", self.run_dir,
             "--listen-fd", str(listener.fileno()), "--stats", self.store_stats],
            pass_fds=[listener.fileno()])
        listener.close()
        ctx.procs.nnodes = cfg.hosts.nnodes
        workers = worker_names(cfg.layout.num_roles)
        standbys = worker_names(cfg.standby.count, "s")
        ctx.membership = C.Membership.initial(cfg.layout, workers, standbys)
        ctx.outbox.extend(("agent", *ctx.spawn_request(n, standby=False)) for n in workers)
        ctx.outbox.extend(("agent", *ctx.spawn_request(n, standby=True)) for n in standbys)
        self.sims = [subprocess.Popen(
            [sys.executable, "-m", "trainmover.bench.control_sim", "--run-dir", self.run_dir,
             "--store", ctx.store_addr, "--spec", json.dumps(self.spec),
             "--part", f"{i}/{self.sim_procs}"],
            stdout=open(self._sim_log(i), "ab"),
            stderr=subprocess.STDOUT) for i in range(self.sim_procs)]
        self._agent_proc = self.sims[0]     # the controller waits for it at the end
        self._connect()
        for name, role in ctx.membership.workers.items():
            ctx.put(P.membership_key(name), role.name)

    def _poll(self) -> bool:
        self._check_sims()
        at, t, cpu = time.time(), time.perf_counter(), time.thread_time()
        try:
            return super()._poll()
        finally:
            self.rounds.append([at, time.perf_counter() - t, time.thread_time() - cpu])

    def _check_sims(self) -> None:
        """A simulator process ends only after every agent it runs stopped: one that ended
        while the job runs failed (its log's last line says why, ``control_sim._serve``)."""
        for i, sim in enumerate(self.sims):
            code = sim.poll()
            if code is not None:
                self._sim_failed = True
                raise SimulatorFailed(f"simulator process {i} exited with code {code} "
                                      f"while the job ran: {last_line(self._sim_log(i))}")

    def _sim_log(self, i: int) -> str:
        return os.path.join(self.run_dir, "logs", f"sim{i}.log")

    def _flush(self, force: bool = False) -> None:
        t, cpu = time.perf_counter(), time.thread_time()
        super()._flush(force)
        if self.rounds:
            self.rounds[-1][1] += time.perf_counter() - t
            self.rounds[-1][2] += time.thread_time() - cpu

    def _stop_all(self) -> None:
        try:
            if self._sim_failed:    # the run is over: no agent to wait for
                for sim in self.sims:
                    sim.kill()
                    sim.wait()
                return
            super()._stop_all()     # every agent shut down; then the simulator exits
            for sim in self.sims[1:]:
                try:
                    sim.wait(timeout=self.cfg.controller.agent_exit_timeout_s)
                except subprocess.TimeoutExpired:
                    sim.kill()
                    sim.wait()
        finally:
            if self.store_proc is not None:
                self.store_proc.kill()
                self.store_proc.wait()


class SimulatorFailed(RuntimeError):
    """A simulator process failed (not the control plane under test)."""


def last_line(path: str, tail_bytes: int = 4096) -> str:
    """The last line of a log that is not empty ("" when there is none)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - tail_bytes))
            lines = [ln for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1] if lines else ""


class CpuSampler:
    """(time, CPU seconds) of some processes every ``interval_s``, from /proc; and the most
    descriptors each held (the store's: its connections; a simulator process's: its hosts'
    connections, both ends of those to their doors), counted every ``DESCRIPTORS_EVERY_S``."""

    def __init__(self, pids: dict[str, int], interval_s: float = 0.25):
        self.pids, self.interval_s = pids, interval_s
        self.samples: dict[str, list[tuple[float, float]]] = {k: [] for k in pids}
        self.most_descriptors: dict[str, int] = {k: 0 for k in pids}
        self._count_at = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            now = time.time()
            count = now >= self._count_at
            if count:
                # seldom, and one listing a process: at 8K workers without the door the
                # store holds ~18K descriptors, read from the controller's process
                self._count_at = now + DESCRIPTORS_EVERY_S
            for name, pid in self.pids.items():
                try:
                    with open(f"/proc/{pid}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                    self.samples[name].append((now, (int(fields[11]) + int(fields[12]))
                                               / CLOCK_TICKS))
                except (OSError, IndexError, ValueError):
                    pass
                if count:
                    self.most_descriptors[name] = max(self.most_descriptors[name],
                                                      open_descriptors(pid))
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


DESCRIPTORS_EVERY_S = 2.0


def open_descriptors(pid: int) -> int:
    """The descriptors process ``pid`` holds open (the store's: its connections, its
    listener and wake pair, and a few files), from /proc: one listing, no look at each."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def rate(samples: list[tuple[float, float]], t0: float, t1: float) -> float | None:
    """The growth per second of a sampled counter between ``t0`` and ``t1``, its values at
    both read by linear interpolation between the samples around them. A short window on
    a loaded machine may hold fewer than two samples (a suite in CI saw none): the
    samples just outside it still bound it. None when no sample precedes ``t0`` or none
    follows ``t1``."""
    if t1 <= t0:
        return None
    at0, at1 = value_at(samples, t0), value_at(samples, t1)
    if at0 is None or at1 is None:
        return None
    return (at1 - at0) / (t1 - t0)


def value_at(samples: list[tuple[float, float]], t: float) -> float | None:
    """A sampled counter's value at ``t``, interpolated between the samples around it."""
    before = [s for s in samples if s[0] <= t]
    after = [s for s in samples if s[0] >= t]
    if not before or not after:
        return None
    (ta, va), (tb, vb) = max(before), min(after)
    if tb == ta:
        return va
    return va + (vb - va) * (t - ta) / (tb - ta)


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def full_nodes(cfg: JobConfig, full_hosts: int, crashed: str) -> list[int]:
    """The hosts simulated whole: the first ``full_hosts`` (the standbys', which a
    recovery promotes, among them), the reporter's and the crashed worker's."""
    layout = cfg.layout
    reporter = reporter_role(layout)      # worker w<rank> holds global rank <rank>
    rank = (reporter.dp * layout.pp + reporter.pp) * layout.tp + reporter.tp
    nodes = set(range(min(cfg.hosts.nnodes, max(full_hosts, cfg.standby.count + 1))))
    nodes |= {rank // WORKERS_PER_HOST, int(crashed[1:]) // WORKERS_PER_HOST}
    return sorted(nodes)


def run_once(workers: int, compute_s: float, warmup: int, steady: int, after: int,
             standbys: int, timeout_s: float, work_dir: str,
             full_hosts: int | None = None,
             overrides: list[tuple[str, str | None]] = (), sim_procs: int = 1) -> dict:
    """One simulated job of ``workers``: ``warmup`` + ``steady`` steps, a crash, ``after``
    more steps; ``full_hosts`` of its hosts simulated whole (None: all), the others light,
    shared among ``sim_procs`` simulator processes. Returns the row of figures (module
    doc)."""
    cfg = sim_config(workers, standbys, overrides)
    run_dir = tempfile.mkdtemp(prefix=f"control-{workers}-", dir=work_dir)
    os.rmdir(run_dir)
    crash_step = warmup + steady
    # a worker of host 2 (a middle one's in a small job), not the reporter
    crashed = f"w{2 * WORKERS_PER_HOST + 1}" if cfg.hosts.nnodes > 3 else f"w{workers // 2 + 1}"
    # the migration's leaver: a worker of host 1, simulated whole, neither the reporter nor
    # in the crashed worker's data-parallel group
    leaver = f"w{WORKERS_PER_HOST + 2}"
    full = None if full_hosts is None else full_nodes(cfg, full_hosts, crashed)
    spec = {"compute_s": compute_s, "crashes": {crashed: crash_step}, "full_nodes": full,
            "samples_path": os.path.join(run_dir + ".store", "samples.json")}
    coord = SimCoordinator(cfg, run_dir, spec, timeout_s, sim_procs)
    box: dict = {}

    def run():
        try:
            # the controller as in a job's own process; what it froze is collected again
            # after (the next repeat runs in this process too)
            box["summary"] = coord.run(own_process=True)
        except BaseException as exc:  # noqa: BLE001 - reported below
            box["error"] = exc
        finally:
            collector.release()

    thread = threading.Thread(target=run, name="controller", daemon=True)
    t_start = time.time()
    thread.start()
    coord.started.wait()
    sampler = None
    target = crash_step + after
    migration = None             # the planned migration's future, once asked for
    deadline = time.monotonic() + timeout_s
    while thread.is_alive() and time.monotonic() < deadline:
        if sampler is None and coord.store_proc is not None and coord.sims:
            sampler = CpuSampler({"store": coord.store_proc.pid,
                                  **{f"sim{i}": p.pid for i, p in enumerate(coord.sims)}})
        recovered = coord.progress.last_step >= target and not coord.recovery.active and \
            not coord.recovery.awaiting
        if recovered and migration is None:
            # then a planned migration, as `trainmover migrate` asks for one
            migration = coord.migrations.request([leaver], source="bench")
        if migration is not None and migration.done():
            break
        time.sleep(0.2)
    coord.stop()
    thread.join(timeout=120)
    if sampler is not None:
        sampler.stop()
    if "error" in box:
        raise RuntimeError(f"the simulated job of {workers} workers failed: "
                           f"{box['error']}") from box["error"]
    if coord.progress.last_step < target:
        raise RuntimeError(f"the simulated job of {workers} workers reached step "
                           f"{coord.progress.last_step} of {target} in {timeout_s} s "
                           f"(run dir {run_dir})")
    result = migration.result(timeout=0) if migration is not None and migration.done() \
        else None
    if result is None or result.get("status") != "done":
        raise RuntimeError(f"the simulated job of {workers} workers: the planned migration "
                           f"of {leaver} did not complete in {timeout_s} s: {result} "
                           f"(run dir {run_dir})")
    return _figures(coord, run_dir, spec, sampler, workers, warmup, crash_step,
                    compute_s, time.time() - t_start, result)


def _figures(coord: SimCoordinator, run_dir: str, spec: dict, sampler: CpuSampler,
             workers: int, warmup: int, crash_step: int, compute_s: float,
             wall_s: float, migration: dict) -> dict:
    rows = []
    for i in range(coord.sim_procs):
        with open(f"{spec['samples_path']}.{i}") as f:
            rows += json.load(f)["rows"]
    # the steady steps: after the warm-up, before the step the crash interrupts; the
    # workers' own (light hosts' rows are their agents': no channel, no local vote)
    steady = [r for r in rows if r[1] == 0 and warmup <= r[2] < crash_step - 1
              and not r[0].startswith("host")]
    overhead = [r[4] for r in steady]
    vote = [r[5] for r in steady]
    t0, t1 = min(r[3] for r in steady), max(r[3] for r in steady)
    with open(coord.store_stats) as f:
        served = [tuple(map(float, line.split())) for line in f if line.strip()]
    rounds = [r for r in coord.rounds if t0 <= r[0] <= t1]   # the steady window's
    events = read_jsonl(os.path.join(run_dir, "events.jsonl"))
    fault = next(e["time"] for e in events if e["event"] == "fault_injected")
    planned = next(e["time"] for e in events if e["event"] == "recovery_planned")
    done = next(e for e in events if e["event"] == "recovery_done")
    started = next(e["time"] for e in events if e["event"] == "migration_started")
    go = next(e["time"] for e in events if e["event"] == "migration_go")
    span = t1 - t0
    return {
        "workers": workers, "hosts": workers // WORKERS_PER_HOST,
        "full_hosts": len(spec["full_nodes"]) if spec["full_nodes"] is not None
        else workers // WORKERS_PER_HOST,
        "layout": coord.cfg.layout.as_dict(), "compute_s": compute_s,
        "steady_steps": crash_step - 1 - warmup, "samples": len(overhead),
        "vote_p50_ms": 1000 * quantile(overhead, 0.5),
        "vote_p99_ms": 1000 * quantile(overhead, 0.99),
        # what a step costs on average (`trainmover project` charges it per step)
        "vote_mean_ms": 1000 * sum(overhead) / len(overhead),
        "vote_call_p50_ms": 1000 * quantile(vote, 0.5),
        "root_store_rps": rate(served, t0, t1),
        # from the crash to the recovery done: the survivors wait for the plan, rebuild
        # and say they are done (what their waits cost the store)
        "recovery_store_rps": rate(served, fault, done["time"]),
        "store_cpu_share": rate(sampler.samples["store"], t0, t1),
        # the most descriptors it held in the run (hosts' doors, the vote relays', the
        # controller's connections, and a few of its own), sampled every 2 s
        "store_connections": sampler.most_descriptors["store"],
        # the busiest simulator process's (against the limit a process: check_descriptors)
        "sim_descriptors": max(sampler.most_descriptors[f"sim{i}"]
                               for i in range(coord.sim_procs)),
        # the busiest simulator process's (each is one core's worth at most)
        "sim_cpu_share": max(rate(sampler.samples[f"sim{i}"], t0, t1) or 0.0
                             for i in range(coord.sim_procs)),
        "sim_procs": coord.sim_procs,
        "controller_round_ms": 1000 * quantile([r[1] for r in rounds], 0.5),
        "controller_round_p99_ms": 1000 * quantile([r[1] for r in rounds], 0.99),
        "controller_round_max_ms": 1000 * max(r[1] for r in rounds),
        # the round's own work, apart from waiting for a core (a saturated machine
        # stretches the wall time of every round, not only the controller's code)
        "controller_round_cpu_ms": 1000 * quantile([r[2] for r in rounds], 0.5),
        "controller_round_cpu_p99_ms": 1000 * quantile([r[2] for r in rounds], 0.99),
        "controller_cpu_share": sum(r[2] for r in rounds) / span if span > 0 else None,
        "crash_to_plan_s": planned - fault,
        "crash_to_resumed_s": done["downtime_s"] - compute_s,
        "recovery_downtime_s": done["downtime_s"],
        # the migration's downtime as the controller accounts it (its slowest stayer's
        # step across the switch, beyond a normal one): with no state to move and no real
        # group to build, what its control protocol costs the stayers
        "migration_control_s": migration["downtime_s"],
        # the step-to-step noise of the stayer it was measured on (core/accounting.py): a
        # downtime below it is not told apart from none
        "migration_noise_s": migration["downtime_noise_s"],
        # the reporter's own step across the switch beyond its normal ones: one worker's,
        # where the slowest of the stayers' is the largest of dozens of noisy steps (every
        # worker's step waits for the same decision)
        "migration_reporter_s": migration["downtime_reporter_s"],
        "migration_to_go_s": go - started,      # orders, background builds, readiness
        "migration_total_s": migration["requested_to_done_s"],
        "migration_stayers": len(migration["stayers"]),
        "wall_s": wall_s,
    }


# The descriptors a simulated job holds a worker, with the default light hosts (measured by
# the ``store_connections`` and ``sim_descriptors`` columns at 1K and 2K workers, one
# simulator process: the store 0.38 and 2.25, a simulator process 5.42 and 2.92 with the
# door and without), rounded up. Through the door a worker's connections are in the
# simulator twice (its end and its door's); without it the store holds them all.
STORE_FDS_PER_WORKER = {True: 0.4, False: 2.3}
SIM_FDS_PER_WORKER = {True: 5.5, False: 3.0}


def check_descriptors(workers: int, cfg: JobConfig, sim_procs: int, limit: int) -> None:
    """A clear error, before anything starts, when the simulated job would need more
    descriptors in the store's process or in a simulator process than ``limit`` (this
    machine's, a process: raising the hard limit needs CAP_SYS_RESOURCE). Past it the
    store refuses connections or an agent fails to open one: hosts that never connect,
    and a run that fails minutes later on another cause."""
    door = bool(cfg.comm.store_proxy)
    store = int(workers * STORE_FDS_PER_WORKER[door])
    if store > limit:
        raise ValueError(
            f"--workers {workers}" + ("" if door else " with --comm.store_proxy=false") +
            f": the store would hold ~{store:,} descriptors, over this machine's limit of "
            f"{limit:,} a process" + ("" if door else " (with the hosts' doors, the default: ~"
                                       f"{int(workers * STORE_FDS_PER_WORKER[True]):,})"))
    per_proc = int(-(-workers // sim_procs) * SIM_FDS_PER_WORKER[door])
    if per_proc > limit:
        need = -(-int(workers * SIM_FDS_PER_WORKER[door]) // limit)
        raise ValueError(
            f"--sim-procs {sim_procs}: {workers} workers would hold ~{per_proc:,} "
            f"descriptors in each simulator process, over this machine's limit of "
            f"{limit:,} a process: use --sim-procs {need} or more")


def bench_control(sizes: list[int], repeats: int, compute_s: float, warmup: int, steady: int,
                  after: int, standbys: int, timeout_s: float, out_dir: str,
                  name: str = "control", keep: bool = False,
                  full_hosts: int | None = 4,
                  overrides: list[tuple[str, str | None]] = (), sim_procs: int = 1) -> dict:
    if sim_procs < 1:
        raise ValueError(f"--sim-procs {sim_procs}: at least one simulator process")
    for n in sizes:      # a bad setting is named before anything starts
        check_descriptors(n, sim_config(n, standbys, overrides), sim_procs,
                          raise_open_files(1 << 20))
    work_dir = tempfile.mkdtemp(prefix="tm-control-")
    rows = []
    try:
        for rep in range(repeats):
            for n in sizes:
                t = time.time()
                row = run_once(n, compute_s, warmup, steady, after, standbys, timeout_s,
                               work_dir, full_hosts, overrides, sim_procs)
                row["repeat"] = rep
                rows.append(row)
                print(f"control: {n} workers, repeat {rep + 1}/{repeats}: step overhead p50 "
                      f"{row['vote_p50_ms']:.1f} ms, p99 {row['vote_p99_ms']:.1f} ms, store "
                      f"{row['root_store_rps']:.0f} req/s, controller round "
                      f"{row['controller_round_ms']:.1f} ms, crash to resumed "
                      f"{row['crash_to_resumed_s']:.2f} s ({time.time() - t:.0f} s)",
                      flush=True)
    finally:
        if keep:
            print(f"control: the simulated jobs' run dirs are kept under {work_dir}",
                  flush=True)
        else:
            shutil.rmtree(work_dir, ignore_errors=True)
    result = {"benchmark": "control", "commit": git_commit(), "machine": machine_description(),
              "command": "trainmover bench control " + " ".join(sys.argv[3:]),
              "settings": {"compute_s": compute_s, "warmup": warmup, "steady": steady,
                           "after": after, "standbys": standbys, "repeats": repeats,
                           "overrides": {k: v for k, v in overrides},
                           "full_hosts": full_hosts, "sim_procs": sim_procs},
              "results": rows}
    write_result(out_dir, name, result, control_table(result))
    return result


COLUMNS = [("vote_p50_ms", "step overhead p50 (ms)", 1), ("vote_p99_ms", "p99 (ms)", 1),
           ("vote_mean_ms", "mean (ms)", 1),
           ("root_store_rps", "root store req/s", 0), ("store_cpu_share", "store CPU", 2),
           ("recovery_store_rps", "req/s in recovery", 0),
           ("store_connections", "store sockets", 0),
           ("sim_descriptors", "simulator descriptors", 0),
           ("controller_round_ms", "controller round p50 (ms)", 1),
           ("controller_round_p99_ms", "p99 (ms)", 1),
           ("controller_round_cpu_ms", "its CPU p50 (ms)", 1),
           ("controller_round_cpu_p99_ms", "p99 (ms)", 1),
           ("controller_cpu_share", "controller CPU", 2),
           ("crash_to_plan_s", "crash to plan (s)", 2),
           ("crash_to_resumed_s", "crash to resumed (s)", 2),
           ("migration_control_s", "migration downtime (s)", 3),
           ("migration_noise_s", "its noise (s)", 3),
           ("migration_reporter_s", "reporter's (s)", 3),
           ("migration_to_go_s", "migration to go (s)", 2),
           ("sim_cpu_share", "simulator CPU", 2)]


def control_table(result: dict) -> str:
    by_size: dict[int, list[dict]] = {}
    for row in result["results"]:
        by_size.setdefault(row["workers"], []).append(row)
    full = result["settings"].get("full_hosts")
    lines = ["# bench control: the control plane against the number of workers",
             "", f"Command: `{result['command']}`; commit {result['commit']}; "
             f"{result['machine']['cores']} cores. Median (min-max) over "
             f"{result['settings']['repeats']} run(s); a step computes "
             f"{result['settings']['compute_s']} s. "
             + ("Every host simulated whole." if not full else
                f"Hosts simulated whole: the first {full}, the reporter's and the crashed "
                f"worker's (the step overhead is their workers'); the others light (their "
                f"agents relay their workers' votes and beats without channels).")
             + "".join(f" The simulated job's {k} = {v} (the default changed)." for k, v in
                       result["settings"].get("overrides", {}).items())
             + (f" The simulated hosts are shared among {procs} simulator processes "
                f"(simulator CPU: the busiest one's)."
                if (procs := result["settings"].get("sim_procs", 1)) > 1 else ""), "",
             "| workers (hosts, whole) | " + " | ".join(c[1] for c in COLUMNS) + " |",
             "|---|" + "---|" * len(COLUMNS)]
    for n, rows in sorted(by_size.items()):
        cells = []
        for key, _, digits in COLUMNS:
            values = [r[key] for r in rows if r.get(key) is not None]
            if not values:
                cells.append("-")
                continue
            med = statistics.median(values)
            cells.append(f"{med:.{digits}f}" if len(values) == 1 else
                         f"{med:.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})")
        lines.append(f"| {n} ({rows[0]['hosts']}, {rows[0].get('full_hosts', '-')}) | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
