"""Scheduled interventions, one syntax for the CLI, tests and benchmarks:
``KIND@STEP:TARGET[:ARG]``:

- ``migrate@12:w3`` hand w3's role to a standby when the job reaches step 12
  (``migrate@12:w3:s1``: to standby s1);
- ``crash@12:w3`` SIGKILL w3 inside step 12, at a point given as ARG: ``forward``,
  ``backward``, ``allreduce`` (gradient all-reduce in flight), ``optimizer`` (after the step
  was committed, before w3 applied it), ``checkpoint`` (half-way through writing one);
  default ``forward``;
- ``hang@12:w3`` SIGSTOP w3 inside step 12 (same points; default ``forward``);
- the same kinds at a point of a migration or of a standby's life, the first time it is
  passed at or after step 12: ``prepare`` (a leaver or stayer starts phase 1), ``switch``
  (a leaver or stayer reached the switch boundary), ``joiner_prepare`` (a joiner starts
  phase 1, for a migration or a recovery), ``joiner_precopy`` (a joiner replayed one of
  the leaver's optimizer steps in a pre-copy, ``migration.precopy``; the step is the
  leaver's), ``joiner_start`` (a joiner has the role's state and is about to train: a
  migration's leaver has left), ``standby`` (a standby registered
  and waits; the step is not checked), ``recover`` (a survivor received its part of a
  recovery plan);
- ``commerr@12:w3`` w3's own communicators fail (aborted) inside step 12;
- ``slow@12:w3:1.3`` w3 computes 1.3 times slower from step 12 on (a sick machine: the
  runtime stretches its steps before the commit point); ``slowlink@12:w3:1.3``: w3's
  communication takes 1.3 times as long from step 12 on;
- ``wedge@12:w3`` w3's main thread blocks forever inside step 12 (same points) while its
  other threads, the heartbeat's included, run on: a deadlock, a stuck data loader;
- ``crash@12:controller[:POINT]`` the controller process SIGKILLs itself (training goes on;
  the agent restarts it, or an operator resumes it): at the first supervision round at or
  after step 12 (``boundary``, default), or once it reached a point of a migration or
  recovery at or after step 12: ``migration_prepare`` (commands sent), ``migration_switch``
  (the switch ordered), ``recovery`` (the recovery plan sent).

Migrations are carried out by the controller; the other kinds by the worker itself at the
named point (``hit``), so they land at an exact place in the step."""
from __future__ import annotations

import re
from dataclasses import dataclass

KINDS = ("migrate", "crash", "hang", "commerr", "wedge", "slow", "slowlink")
WORKER_KINDS = ("crash", "hang", "commerr", "wedge")
SLOW_KINDS = ("slow", "slowlink")   # from a step on, for as long as the worker holds its role
CONTROLLER = "controller"
JOINER = "joiner"   # whichever standby is promoted first (warm-up order decides which)
CONTROLLER_POINTS = ("boundary", "migration_prepare", "migration_switch", "recovery")


@dataclass(frozen=True)
class Inject:
    kind: str
    step: int
    target: str
    arg: str | None = None

    def __str__(self) -> str:
        return f"{self.kind}@{self.step}:{self.target}" + (f":{self.arg}" if self.arg else "")


_SYNTAX = re.compile(r"(?P<kind>[a-z]+)@(?P<step>\d+):(?P<target>[A-Za-z0-9_.-]+)"
                     r"(?::(?P<arg>[A-Za-z0-9_.-]+))?")


def slow_factor(inj: Inject) -> float:
    """The factor of a ``slow``/``slowlink`` inject (its ARG): a number over 1."""
    try:
        factor = float(inj.arg) if inj.arg is not None else None
    except ValueError:
        factor = None
    if factor is None or not 1.0 < factor <= 100.0:
        raise ValueError(f"inject {inj}: the slowdown factor {inj.arg!r} must be a number "
                         f"over 1 and at most 100, e.g. {inj.kind}@{inj.step}:{inj.target}:1.3")
    return factor


def parse_inject(text: str) -> Inject:
    m = _SYNTAX.fullmatch(text.strip())
    if not m:
        raise ValueError(f"bad inject {text!r}: expected KIND@STEP:TARGET[:ARG], "
                         f"e.g. migrate@12:w3")
    if m["kind"] not in KINDS:
        raise ValueError(f"bad inject {text!r}: unknown kind {m['kind']!r} "
                         f"(known: {', '.join(KINDS)})")
    return Inject(m["kind"], int(m["step"]), m["target"], m["arg"])


def validate_injects(injects: list[Inject], steps: int, workers: list[str],
                     standbys: list[str]) -> None:
    """Checks that need the job: steps in range (``steps`` 0: the count is not known),
    targets that exist. Raises ValueError."""
    for inj in injects:
        if inj.step < 1 or (steps and inj.step >= steps):
            raise ValueError(f"inject {inj}: step {inj.step} is outside 1..{steps - 1}"
                             if steps else f"inject {inj}: step {inj.step} must be >= 1")
        if inj.target == CONTROLLER:
            if inj.kind != "crash":
                raise ValueError(f"inject {inj}: the controller can only crash")
            if inj.arg is not None and inj.arg not in CONTROLLER_POINTS:
                raise ValueError(f"inject {inj}: unknown controller point {inj.arg!r} "
                                 f"(known: {', '.join(CONTROLLER_POINTS)})")
            continue
        if inj.kind in SLOW_KINDS:
            if inj.target not in workers:
                raise ValueError(f"inject {inj}: unknown worker {inj.target!r}")
            slow_factor(inj)
            continue
        standby_point = inj.kind in WORKER_KINDS and inj.arg in STANDBY_POINTS
        if inj.target == JOINER:
            if inj.kind not in WORKER_KINDS or inj.arg not in JOINER_POINTS:
                raise ValueError(f"inject {inj}: the target {JOINER!r} (whichever standby is "
                                 f"promoted first) goes with a point of "
                                 f"{', '.join(JOINER_POINTS)}")
            continue
        if inj.target not in workers and not (standby_point and inj.target in standbys):
            raise ValueError(f"inject {inj}: unknown worker {inj.target!r}")
        if inj.kind in WORKER_KINDS and inj.arg is not None and inj.arg not in POINTS:
            raise ValueError(f"inject {inj}: unknown point {inj.arg!r} "
                             f"(known: {', '.join(POINTS)})")
        if inj.kind == "commerr" and inj.arg is not None and inj.arg not in COMMERR_POINTS:
            raise ValueError(f"inject {inj}: no communicator of the worker is in use at point "
                             f"{inj.arg!r}, so it could never fail there (commerr points: "
                             f"{', '.join(COMMERR_POINTS)})")
        if inj.target in workers and inj.arg in STANDBY_POINTS:
            raise ValueError(f"inject {inj}: {inj.target} is a worker, which never passes the "
                             f"standby point {inj.arg!r} (target a standby, or "
                             f"'{JOINER}' for whichever is promoted first)")
        if inj.kind == "migrate":
            if not standbys:
                raise ValueError(f"inject {inj}: the job has no standby (use --standbys)")
            if inj.arg is not None and inj.arg not in standbys:
                raise ValueError(f"inject {inj}: {inj.arg!r} is not a standby of this job")
    seen = set()
    for inj in injects:
        key = (inj.kind, inj.target)
        if key in seen and inj.kind == "migrate":
            raise ValueError(f"inject {inj}: worker {inj.target} is migrated twice (it leaves "
                             f"the job the first time)")
        seen.add(key)


# --- faults carried out by the worker itself -----------------------------------------------
# Some faults must happen at an exact point inside a process (half-way through preparing a
# migration, inside a step). The job's configuration lists them; each worker checks the
# named points it passes and kills itself with SIGKILL there: no clean-up, as in a crash.

STEP_POINTS = ("forward", "backward", "allreduce", "optimizer", "checkpoint")
# passed at most once per migration or process, at a step only known approximately: they
# fire the first time they are passed at or after the fault's step
EVENT_POINTS = ("prepare", "switch", "joiner_prepare", "joiner_precopy", "joiner_start",
                "standby", "recover")
POINTS = STEP_POINTS + EVENT_POINTS
# passed by standbys only
STANDBY_POINTS = ("joiner_prepare", "joiner_precopy", "joiner_start", "standby")
JOINER_POINTS = ("joiner_prepare", "joiner_precopy", "joiner_start")
# where a worker's own communicators are in use, so that failing them is meaningful
COMMERR_POINTS = ("forward", "backward", "allreduce", "optimizer", "prepare", "switch")


@dataclass(frozen=True)
class WorkerFault:
    worker: str
    point: str
    step: int | None = None   # None: the first time the point is passed
    kind: str = "crash"
    factor: float | None = None   # slow kinds

    def validate(self) -> None:
        if self.point not in POINTS:
            raise ValueError(f"unknown fault point {self.point!r} (known: {', '.join(POINTS)})")
        if self.kind not in WORKER_KINDS + SLOW_KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}")


def worker_faults(injects: list[Inject]) -> list[dict]:
    """The injects a worker carries out itself, in the form the job configuration holds."""
    out = []
    for inj in injects:
        if inj.kind in SLOW_KINDS:
            out.append(WorkerFault(inj.target, "forward", inj.step, inj.kind,
                                   slow_factor(inj)).__dict__)
        elif inj.kind in WORKER_KINDS and inj.target != CONTROLLER:
            point = inj.arg or "forward"
            fault = WorkerFault(inj.target, point, inj.step, inj.kind)
            fault.validate()
            out.append(fault.__dict__)
    return out


def hit(faults: list[dict], worker: str, point: str, step: int | None = None,
        events=None, on_commerr=None, store=None) -> None:
    """Called by a worker at a named point: carries out a matching fault. A crash is SIGKILL
    (no clean-up, as in a real crash), a hang SIGSTOP; the event is logged first, so the
    detection latency can be measured from it. With the job's store, each fault fires once
    per job: a restarted process redoing the step does not crash again."""
    import os
    import signal

    for index, f in enumerate(faults):
        if f.get("kind") in SLOW_KINDS:
            continue   # not a point event: the runtime applies it (``slowdowns``)
        if f["point"] != point or f["worker"] not in (worker, JOINER):
            continue
        at = f.get("step")
        if point in EVENT_POINTS:
            if at is not None and step is not None and step < at:
                continue
        elif at not in (None, step):
            continue
        if store is not None and store.add(f"faults/{index}/fired", 1) != 1:
            continue
        kind = f.get("kind", "crash")
        if events is not None:
            events.emit("fault_injected", kind=kind, point=point, step=step)
        if kind == "crash":
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "hang":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif kind == "commerr" and on_commerr is not None:
            on_commerr()
        elif kind == "wedge":
            import time
            while True:        # releases the GIL: every other thread runs on
                time.sleep(3600)


def slowdowns(faults: list[dict], worker: str) -> dict[str, tuple[int, float]]:
    """The worker's slow faults: kind -> (from step, factor)."""
    return {f["kind"]: (f["step"], f["factor"]) for f in faults
            if f.get("kind") in SLOW_KINDS and f["worker"] == worker}
