"""A running job as seen from outside it: who holds which role, the standbys, the processes'
PIDs, the last committed step, what is in flight. Read from the controller's snapshot in the
job's store (authenticated with the run dir's secret, so only the job's owner can read it)
and from the agent's process records; nothing is asked of the controller, so this works
while the controller is down or being restarted (the view is then as of its last save)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from trainmover.control.client import connect
from trainmover.control.coordinator import SNAPSHOT_CODEC
from trainmover.core import protocol as P
from trainmover.core.proc import pid_alive


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

    def free_standbys(self, state: str = "warm") -> list[str]:
        return [s.name for s in self.standbys if s.state == state and s.alive]


def read_status(run_dir: str, store=None) -> JobStatus:
    """The job's status now; raises ValueError if it cannot be read (not running, no
    snapshot yet). ``store``: a client from ``client.connect`` to reuse."""
    store = store or connect(run_dir)
    if not store.check([P.CONTROLLER_SNAPSHOT_KEY]):
        raise ValueError(f"the job in {run_dir!r} has no controller snapshot yet")
    state = SNAPSHOT_CODEC.loads(store.get(P.CONTROLLER_SNAPSHOT_KEY))
    ctx, procs = state["ctx"], state["ctx"]["procs"]
    m = ctx["membership"]

    def proc(name: str, **extra) -> ProcessStatus:
        view = procs.procs.get(name)
        pid = view.pid if view is not None else None
        alive = view is not None and view.code is None and pid is not None and pid_alive(pid)
        return ProcessStatus(name, pid, view.node if view is not None else 0, alive, **extra)

    controller = None
    if store.check([P.CONTROLLER_KEY]):
        controller = P.read_message(P.ControllerInfo, store.get(P.CONTROLLER_KEY))
    mig, rec = state["migrations"]["active"], state["recovery"]["active"]
    return JobStatus(
        committed_step=ctx["committed"], epoch=ctx["epoch"],
        workers=[proc(w, role=r.name, perf=_perf(store, w))
                 for w, r in sorted(m.workers.items())],
        standbys=[proc(s, state=st.value) for s, st in sorted(m.standbys.items())],
        controller_pid=controller.pid if controller else None,
        controller_alive=bool(controller and pid_alive(controller.pid)),
        migration_in_flight=None if mig is None else mig.plan.migration_id,
        recovery_in_flight=None if rec is None else rec.recovery_id,
        migrations=list(state["migrations"]["finished"]),
        recoveries=list(state["recovery"]["done"]),
        stragglers=list(state.get("stragglers", {}).get("found", [])),
        store_keys=store.raw.num_keys() if hasattr(store, "raw") else None)


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
    lines = [f"step {st.committed_step} (epoch {st.epoch}); controller "
             f"{'PID ' + str(st.controller_pid) if st.controller_pid else '?'}"
             f"{'' if st.controller_alive else ' (down: restarting?)'}; store keys "
             f"{st.store_keys}",
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
