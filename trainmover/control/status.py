"""A running job as seen from outside it: who holds which role, the standbys, the processes'
PIDs, the last committed step, what is in flight.

Two sources, one shape (``JobStatus``): the controller writes ``<run dir>/status.json``
(mode 0600) every ``controller.status_interval_s`` from its live state, which a reader
takes without importing torch or touching the store (``trainmover status`` answers in tens
of milliseconds); when that file is stale (the controller is down or being restarted),
``read_status`` reads the controller's snapshot in the job's store (authenticated with the
run dir's secret) and the agent's process records instead, so status works then too (the
view is as of the last save)."""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field

from trainmover.core import protocol as P
from trainmover.core.proc import pid_alive

STATUS_FILE = "status.json"
# status.json older than this many of the controller's write intervals is stale (the
# controller is down, or too busy to write it): the store is read instead
STATUS_FRESH_INTERVALS = 3


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

    def free_standbys(self, state: str = "warm") -> list[str]:
        return [s.name for s in self.standbys if s.state == state and s.alive]


def status_from_state(state: dict, perf: dict[str, dict | None], controller_pid: int | None,
                      store_keys: int | None = None, source: str = "store") -> JobStatus:
    """The status in a controller's state (``Coordinator._snapshot()``: live, or as read
    back from the store); ``perf``: each worker's newest ``StepPerf`` as a dict."""
    ctx, procs = state["ctx"], state["ctx"]["procs"]
    m = ctx["membership"]

    def proc(name: str, **extra) -> ProcessStatus:
        view = procs.procs.get(name)
        pid = view.pid if view is not None else None
        alive = view is not None and view.code is None and pid is not None and pid_alive(pid)
        return ProcessStatus(name, pid, view.node if view is not None else 0, alive, **extra)

    mig, rec = state["migrations"]["active"], state["recovery"]["active"]
    return JobStatus(
        committed_step=ctx["committed"], epoch=ctx["epoch"],
        workers=[proc(w, role=r.name, perf=perf.get(w)) for w, r in sorted(m.workers.items())],
        standbys=[proc(s, state=st.value) for s, st in sorted(m.standbys.items())],
        controller_pid=controller_pid,
        controller_alive=bool(controller_pid and pid_alive(controller_pid)),
        migration_in_flight=None if mig is None else mig.plan.migration_id,
        recovery_in_flight=None if rec is None else rec.recovery_id,
        migrations=list(state["migrations"]["finished"]),
        recoveries=list(state["recovery"]["done"]),
        stragglers=list(state.get("stragglers", {}).get("found", [])),
        store_keys=store_keys, as_of=time.time(), source=source)


def write_status_file(run_dir: str, status: JobStatus) -> None:
    """``status.json``, replaced atomically (a reader never sees half of it)."""
    path = os.path.join(run_dir, STATUS_FILE)
    fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(status), f)
    os.replace(path + ".tmp", path)


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
    if not isinstance(data, dict) or time.time() - (data.get("as_of") or 0) > max_age_s:
        return None
    if not (data.get("controller_pid") and pid_alive(data["controller_pid"])):
        return None
    try:
        data["workers"] = [ProcessStatus(**w) for w in data["workers"]]
        data["standbys"] = [ProcessStatus(**s) for s in data["standbys"]]
        return JobStatus(**data)
    except TypeError:
        return None     # written by another version: read the store


def read_status(run_dir: str, store=None) -> JobStatus:
    """The job's status now, from the store; raises ValueError if it cannot be read (not
    running, no snapshot yet). ``store``: a client from ``client.connect`` to reuse."""
    from trainmover.control.client import connect
    from trainmover.control.snapshot_codec import SNAPSHOT_CODEC

    store = store or connect(run_dir)
    if not store.check([P.CONTROLLER_SNAPSHOT_KEY]):
        raise ValueError(f"the job in {run_dir!r} has no controller snapshot yet")
    state = SNAPSHOT_CODEC.loads(store.get(P.CONTROLLER_SNAPSHOT_KEY))
    controller = None
    if store.check([P.CONTROLLER_KEY]):
        controller = P.read_message(P.ControllerInfo, store.get(P.CONTROLLER_KEY))
    workers = state["ctx"]["membership"].workers
    return status_from_state(state, {w: _perf(store, w) for w in workers},
                             controller.pid if controller else None,
                             store.raw.num_keys() if hasattr(store, "raw") else None)


def _perf(store, worker: str) -> dict | None:
    key = P.perf_key(worker)
    if not store.check([key]):
        return None
    try:
        return asdict(P.read_message(P.StepPerf, store.get(key)))
    except P.MessageError:
        return None


def render(st: JobStatus) -> str:
    """The status as a terminal page."""
    age = f"; as of {time.time() - st.as_of:.1f} s ago from the {st.source}" \
        if st.as_of else ""
    lines = [f"step {st.committed_step} (epoch {st.epoch}); controller "
             f"{'PID ' + str(st.controller_pid) if st.controller_pid else '?'}"
             f"{'' if st.controller_alive else ' (down: restarting?)'}; store keys "
             f"{st.store_keys}{age}",
             "in flight: " + (", ".join(filter(None, [
                 st.migration_in_flight and f"migration {st.migration_in_flight}",
                 st.recovery_in_flight and f"recovery {st.recovery_in_flight}"])) or "nothing"),
             "", f"{'worker':8} {'role':14} {'host':>4} {'pid':>8} {'step ms':>8} "
             f"{'compute ms':>10} {'wait ms':>8}"]
    for w in st.workers:
        p = w.perf or {}
        wait = sum(p.get("wait_s", {}).values()) if p else None
        lines.append(f"{w.name:8} {w.role:14} {w.node:>4} {str(w.pid):>8} "
                     f"{_ms(p.get('step_s')):>8} {_ms(p.get('compute_s')):>10} "
                     f"{_ms(wait):>8}" + ("" if w.alive else "  (not running)"))
    lines += ["", f"{'standby':8} {'state':10} {'host':>4} {'pid':>8}"]
    lines += [f"{s.name:8} {s.state:10} {s.node:>4} {str(s.pid):>8}"
              + ("" if s.alive else "  (not running)") for s in st.standbys]
    for title, items in (("migrations", st.migrations), ("recoveries", st.recoveries),
                         ("stragglers", st.stragglers)):
        if items:
            lines += ["", f"{title} ({len(items)}), newest:", "  " + _brief(items[-1])]
    return "\n".join(lines)


def _ms(seconds) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def _brief(item: dict) -> str:
    keys = ("status", "pairs", "failures", "downtime_s", "worker", "score", "step")
    return ", ".join(f"{k}={item[k]}" for k in keys if k in item)


# --- a job that is not running any more ----------------------------------------------------

def ended(run_dir: str, fresh_s: float) -> dict | None:
    """The outcome of a job whose processes are gone (its agent, which outlives every other
    process of the job, is not running here, and the run wrote its summary or its controller
    stopped writing status: an agent on another host is not seen from this one), else None:
    {"state": "finished" | "stopped" | "ended", "summary": the summary or None,
    "last_error": the job_failed event, else the newest error event, or None}."""
    from trainmover.core import jobfile
    from trainmover.core.events import read_jsonl

    try:
        agent = jobfile.read_control(run_dir).get("agent_pid")
    except (OSError, ValueError):
        return None        # no job was started here (status says so its own way)
    if isinstance(agent, int) and pid_alive(agent):
        return None
    summary, path = None, os.path.join(run_dir, "summary.json")
    try:
        # a summary older than the run's start (run.json: rewritten by each launch and
        # --resume) is the one of the run before a --resume
        if os.path.getmtime(path) >= os.path.getmtime(os.path.join(run_dir, jobfile.RUN_FILE)):
            with open(path) as f:
                summary = json.load(f)
    except (OSError, ValueError):
        pass
    if summary is None and read_status_file(run_dir, fresh_s) is not None:
        return None        # no summary yet, and a controller writing status: still running
    events = os.path.join(run_dir, "events.jsonl")
    errors = [e for e in read_jsonl(events) if e.get("level") == "error"] \
        if os.path.exists(events) else []
    # the event that ended the job is what to show: workers still exiting after it may log
    # their own errors later (every worker of a script failing before init does)
    ending = [e for e in errors if e.get("event") == "job_failed"]
    last = (ending or errors or [None])[-1]
    state = "ended" if summary is None else "stopped" if summary.get("stopped") else "finished"
    return {"state": state, "summary": summary, "last_error": last}


def render_ended(run_dir: str, outcome: dict) -> str:
    s, state = outcome["summary"], outcome["state"]
    if state == "ended":
        err = outcome["last_error"]
        why = ""
        if err:
            # a failure's message is its headline, then the last log lines of the worker
            # behind it: the headline and the last of those (where the script's own error is)
            text = str(err.get("error") or err.get("reason") or "").strip().splitlines()
            shown = text[:1] + (["  ..."] if len(text) > 4 else []) + text[1:][-3:]
            why = f"; last error: {err.get('event')}: " + "\n".join(shown)
        return (f"job in {run_dir} is not running and left no summary (it failed or was "
                f"killed){why}\nevents: {run_dir}/events.jsonl; logs: {run_dir}/logs/; "
                f"continue from its newest checkpoint with `trainmover run --resume "
                f"{run_dir}`")
    if state == "stopped":
        return (f"job {s.get('name', '')!r} stopped at step {s.get('resume_step')} "
                f"({s.get('reason', 'asked')}); continue with `trainmover run --resume "
                f"{run_dir}`\nsummary: {run_dir}/summary.json")
    lines = [f"job {s.get('name', '')!r} finished: {s.get('steps')} steps"
             + (f", final loss {s['final_loss']:.4f}" if s.get("final_loss") is not None
                else "")
             + f", {s.get('wall_s', 0):.1f} s"
             + (f" (mean step {s['mean_step_time_s'] * 1000:.1f} ms)"
                if s.get("mean_step_time_s") else "")]
    layout = s.get("layout") or {}
    lines.append(f"layout dp{layout.get('dp')}.pp{layout.get('pp')}.tp{layout.get('tp')}: "
                 f"{s.get('workers')} workers + {s.get('standbys')} standby")
    moves = s.get("migrations") or []
    recs = s.get("recoveries") or []
    lines.append(f"migrations: {sum(m.get('status') == 'done' for m in moves)} done of "
                 f"{len(moves)}; recoveries: {sum(r.get('status') == 'done' for r in recs)} "
                 f"done of {len(recs)} (steps lost: "
                 f"{sum(r.get('lost_steps') or 0 for r in recs)}); stragglers: "
                 f"{len(s.get('stragglers') or [])}")
    agree = s.get("replicas_agree")
    lines.append("replicas: " + {True: "agree", False: "DISAGREE (see replicas_disagree in "
                                 "events.jsonl)", None: "none to compare"}[agree])
    lines.append(f"weights_sha256 {s.get('weights_sha256')}; final checkpoint "
                 f"{s.get('checkpoint')}")
    lines.append(f"summary: {run_dir}/summary.json; events: {run_dir}/events.jsonl")
    return "\n".join(lines)
