"""What a running job's status holds (``JobStatus``) and how the controller keeps it in
``<run dir>/status.json`` for ``trainmover status`` and the dashboard.

The file holds the processes as columns, one list a field (a process's row is its index in
each), and the step measurements' times as whole microseconds. Written as one object a
worker, a write took 0.17-0.19 s of the controller's round at 16,384 workers (json's
callback for each worker's dataclass, the field names repeated in every row, the shortest
decimal form of every float); as columns of integers 0.07 s (``benchmarks/status_write.py``,
results/status_write_columns.md). The reader turns the columns back into rows, so the
shape seen by everything else (``status --json``, the dashboard) is ``JobStatus`` as before.
A microsecond is finer than anything the status shows (step times in milliseconds)."""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field

from trainmover.core import rundir
from trainmover.core.proc import pid_alive

STATUS_FILE = "status.json"
# status.json older than this many of the controller's write intervals is stale (the
# controller is down, or too busy to write it): the store is read instead
STATUS_FRESH_INTERVALS = 3
# The longest interval a controller writes status.json at, however many workers (a write of
# 100K workers' status takes about 2 s here: every 40 s at its 5% share), and the longest a
# reader honours whatever the file says
STATUS_MAX_INTERVAL_S = 60.0
# The file's layout: a file of another (an older version's) is not read (the store is)
STATUS_FORMAT = 2

# A worker's step measurements as the status keeps them (``StepPerf`` without its history of
# windows; its role is the worker's): the steps and the host's readings as they are, the
# times in whole microseconds
PERF_AS_IS = ("first_step", "last_step", "tenure_start", "load1", "steal", "gpu_clock_mhz",
              "gpu_temp_c")
PERF_TIMES = ("step_s", "compute_s")
_US = 1_000_000
# a time beyond this (or not a number: NaN) is shown as unknown rather than encoded
_TIME_LIMIT_S = 1e9


@dataclass
class ProcessStatus:
    name: str
    pid: int | None
    node: int
    alive: bool
    role: str | None = None          # a worker's role
    state: str | None = None         # a standby's state (starting, cold, warm, ...)
    perf: dict | None = None         # a worker's newest step measurements (StepPerf)


@dataclass
class JobStatus:
    committed_step: int
    epoch: int
    workers: list[ProcessStatus]
    standbys: list[ProcessStatus]
    controller_pid: int | None
    controller_alive: bool
    migration_in_flight: int | None          # its id
    recovery_in_flight: int | None
    migrations: list[dict] = field(default_factory=list)    # finished ones, as reported
    recoveries: list[dict] = field(default_factory=list)
    stragglers: list[dict] = field(default_factory=list)
    store_keys: int | None = None
    as_of: float | None = None               # when this view was taken (unix seconds)
    source: str = "store"                    # "controller" (status.json) | "store"
    interval_s: float | None = None          # how often the controller writes status.json

    def free_standbys(self, state: str = "warm") -> list[str]:
        return [s.name for s in self.standbys if s.state == state and s.alive]


def status_columns(state: dict, perf: dict[str, dict | None], controller_pid: int | None,
                   store_keys: int | None = None, source: str = "store",
                   recorded: bool = False) -> dict:
    """The status in a controller's state (``Coordinator._snapshot()``: live, or as read
    back from the store) as status.json holds it; ``perf``: each worker's newest
    ``StepPerf`` as a dict (``status.status_perf``), shown while it is of the worker's
    present role.

    ``recorded``: a process is alive while the agents' records say it runs (started, no
    exit recorded): the controller's own view, kept current every round, on every host.
    Otherwise (read back from the store while the controller is down) its PID is also
    probed here: a process that died since the last save shows dead (on this host; another
    host's PID means nothing here)."""
    ctx, procs = state["ctx"], state["ctx"]["procs"].procs
    m = ctx["membership"]
    names = sorted(m.workers)
    roles = [m.workers[w].name for w in names]
    rows = [perf.get(w) for w in names]
    rows = [p if p is not None and p.get("role") == r else None for p, r in zip(rows, roles)]
    workers = _processes(names, procs, recorded)
    workers["role"] = roles
    # a comprehension a column (a row a worker made tuples enough for the garbage collector
    # to cost more than the copying); every measurement dict has all the fields (status_perf)
    columns = {k: [None if p is None else p[k] for p in rows] for k in PERF_AS_IS}
    for k in PERF_TIMES:
        columns[k] = _micros([None if p is None else p[k] for p in rows])
    waits = [None if p is None else p["wait_s"] for p in rows]
    kinds = sorted({k for wait in waits if wait for k in wait})
    columns["wait_s"] = {k: _micros([None if w is None else w.get(k) for w in waits])
                         for k in kinds}
    columns["held"] = [p is not None for p in rows]
    workers["perf"] = columns
    standby_names = sorted(m.standbys)
    standbys = _processes(standby_names, procs, recorded)
    standbys["state"] = [m.standbys[s].value for s in standby_names]
    mig, rec = state["migrations"]["active"], state["recovery"]["active"]
    return {
        "format": STATUS_FORMAT, "committed_step": ctx["committed"], "epoch": ctx["epoch"],
        "workers": workers, "standbys": standbys, "controller_pid": controller_pid,
        "controller_alive": bool(controller_pid and pid_alive(controller_pid)),
        "migration_in_flight": None if mig is None else mig.plan.migration_id,
        "recovery_in_flight": None if rec is None else rec.recovery_id,
        "migrations": list(state["migrations"]["finished"]),
        "recoveries": list(state["recovery"]["done"]),
        "stragglers": list(state.get("stragglers", {}).get("found", [])),
        "store_keys": store_keys, "as_of": time.time(), "source": source, "interval_s": None}


def _processes(names: list[str], procs: dict, recorded: bool) -> dict[str, list]:
    views = [procs.get(n) for n in names]
    pids = [None if v is None else v.pid for v in views]
    return {"name": names, "pid": pids, "node": [0 if v is None else v.node for v in views],
            "alive": [v is not None and v.code is None and pid is not None and
                      (recorded or pid_alive(pid)) for v, pid in zip(views, pids)]}


def _micros(seconds) -> list[int | None]:
    return [round(t * _US) if t is not None and -_TIME_LIMIT_S < t < _TIME_LIMIT_S else None
            for t in seconds]


def status_from_columns(data: dict) -> JobStatus:
    """The ``JobStatus`` a status file's content (``status_columns``) holds; raises
    ``KeyError``, ``TypeError``, ``IndexError`` or ``ValueError`` for a content of another
    shape."""
    if data.get("format") != STATUS_FORMAT:
        raise ValueError(f"status format {data.get('format')!r}, not {STATUS_FORMAT}")
    w, s = data["workers"], data["standbys"]
    perf = w["perf"]
    times = {k: perf[k] for k in PERF_TIMES}
    waits = perf["wait_s"]

    def measured(i: int, role: str) -> dict | None:
        if not perf["held"][i]:
            return None
        out = {"role": role, **{k: perf[k][i] for k in PERF_AS_IS[:3]},
               **{k: _seconds(times[k][i]) for k in PERF_TIMES},
               "wait_s": {k: col[i] / _US for k, col in waits.items() if col[i] is not None}}
        out.update((k, perf[k][i]) for k in PERF_AS_IS[3:])
        return out

    workers = [ProcessStatus(name, pid, node, alive, role=role, perf=measured(i, role))
               for i, (name, pid, node, alive, role) in enumerate(
                   zip(w["name"], w["pid"], w["node"], w["alive"], w["role"], strict=True))]
    standbys = [ProcessStatus(name, pid, node, alive, state=st) for name, pid, node, alive, st
                in zip(s["name"], s["pid"], s["node"], s["alive"], s["state"], strict=True)]
    rest = {k: v for k, v in data.items() if k not in ("format", "workers", "standbys")}
    return JobStatus(workers=workers, standbys=standbys, **rest)


def _seconds(micros: int | None) -> float | None:
    return None if micros is None else micros / _US


def write_status_file(run_dir: str, data: dict) -> None:
    """``status.json`` (mode 0600) holding ``data`` (``status_columns``), replaced atomically
    (a reader never sees half of it), not written through a symlink planted in its place."""
    rundir.write_atomic(os.path.join(run_dir, STATUS_FILE),
                        json.dumps(data, separators=(",", ":")).encode())


def fresh_limit_s(run_dir: str) -> float:
    """How old the job's status.json may be and still be read (its job.json's interval)."""
    from trainmover.core import jobfile

    path = os.path.join(run_dir, "job.json")
    if not os.path.exists(path):
        raise ValueError(f"{run_dir!r} holds no job (no job.json)")
    cfg = jobfile.read_job(run_dir)
    return STATUS_FRESH_INTERVALS * cfg.controller.status_interval_s


def read_status_file(run_dir: str, max_age_s: float) -> JobStatus | None:
    """The controller's ``status.json`` if it is at most ``max_age_s`` old and its writer
    still runs; else None (read the store)."""
    try:
        with open(os.path.join(run_dir, STATUS_FILE)) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    # a controller of many workers writes the file less often than configured, and says so
    every = data.get("interval_s")
    if isinstance(every, (int, float)):
        max_age_s = max(max_age_s, STATUS_FRESH_INTERVALS * min(every, STATUS_MAX_INTERVAL_S))
    if time.time() - (data.get("as_of") or 0) > max_age_s:
        return None
    if not (data.get("controller_pid") and pid_alive(data["controller_pid"])):
        return None
    try:
        return status_from_columns(data)
    except (KeyError, TypeError, IndexError, ValueError, AttributeError):
        return None     # written by another version: read the store
