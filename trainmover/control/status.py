"""A running job as seen from outside it: who holds which role, the standbys, the processes'
PIDs, the last committed step, what is in flight.

Two sources, one shape (``JobStatus``): the controller writes ``<run dir>/status.json``
(mode 0600, ``status_file``) every ``controller.status_interval_s`` from its live state,
which a reader takes without importing torch or touching the store (``trainmover status``
answers in tens of milliseconds); when that file is stale (the controller is down or being
restarted), ``read_status`` reads the controller's snapshot (the newest genuine copy of the
store's and the run dir's, signed with the run's key: ``snapshot_codec``) and the agent's
process records instead, so status works then too (the view is as of the last save)."""
from __future__ import annotations

import json
import os
import time

from trainmover.control.status_file import (JobStatus, read_status_file, status_columns,
                                            status_from_columns)
from trainmover.core import protocol as P
from trainmover.core.auth import read_valid
from trainmover.core.proc import pid_alive


def status_from_state(state: dict, perf: dict[str, dict | None], controller_pid: int | None,
                      store_keys: int | None = None, source: str = "store",
                      recorded: bool = False) -> JobStatus:
    """The status in a controller's state, as the status file would hold it
    (``status_file.status_columns``, whose arguments these are)."""
    return status_from_columns(status_columns(state, perf, controller_pid, store_keys, source,
                                              recorded))


def read_status(run_dir: str, store=None) -> JobStatus:
    """The job's status now, from the store; raises ValueError if it cannot be read (not
    running, no snapshot yet). ``store``: a client from ``client.connect`` to reuse."""
    from trainmover.control.client import connect
    from trainmover.control.snapshot_codec import read_newest
    from trainmover.core import jobfile

    store = store or connect(run_dir)
    # the newest genuine copy, the store's or the run dir's (junk at the store's key is
    # passed over)
    _, state, _ = read_newest(run_dir, store, jobfile.run_key(run_dir))
    controller = None
    raw = store.valid(P.CONTROLLER_KEY)      # junk there: no controller known
    if raw is not None:
        try:
            controller = P.read_message(P.ControllerInfo, raw)
        except P.MessageError:
            pass
    return status_from_state(state, _perfs(store, state["ctx"]["procs"],
                                           state["ctx"]["membership"].workers),
                             controller.pid if controller else None,
                             store.raw.num_keys() if hasattr(store, "raw") else None)


def _perfs(store, procs, workers) -> dict[str, dict]:
    """Each role holder's newest step measurements, from its host's ``HostPerf`` (one key a
    host, ``agent/perfs.py``); a host's value that is junk is passed over."""
    nodes = [n for n in range(procs.nnodes) if n not in procs.lost]
    out = {}
    for raw in read_valid(store, [P.agent_key(n, "perf") for n in nodes]):
        try:
            host = None if raw is None else P.read_message(P.HostPerf, raw)
        except P.MessageError:
            continue
        for w, perf in (host.workers if host is not None else {}).items():
            if w in workers and perf.role == workers[w].name:
                out[w] = status_perf(perf)
    return out


def status_perf(perf: P.StepPerf) -> dict:
    """A worker's step measurements as the status shows them: the newest window's, without
    the history of windows kept for the straggler detector (a status interval's encoding of
    every worker's history was most of the file's cost, and nothing reads it there)."""
    return {k: v for k, v in vars(perf).items() if k != "recent"}


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
    from trainmover.core.accounting import downtime_phrase

    keys = ("status", "pairs", "failures", "worker", "score", "step")
    text = ", ".join(f"{k}={item[k]}" for k in keys if k in item)
    if "downtime_s" in item:     # one inside the step noise says so (core/accounting.py)
        text += ", " + downtime_phrase(item["downtime_s"], item.get("downtime_noise_s"))
    return text


# --- a job that is not running any more ----------------------------------------------------
# Read from the run dir alone, at once: no store to reach (its address may now be another
# process's, and a client would wait out its connect timeout), no torch.

ENDED_STATES = ("finished", "stopped", "failed")
# the tail of metrics.jsonl read for the last committed step (a long job's file is large)
METRICS_TAIL_BYTES = 64 * 1024


def ended(run_dir: str, fresh_s: float) -> dict | None:
    """The outcome of a job whose processes are gone, else None (still running, or nothing
    started here). A job is over when its run wrote a summary (finished or stopped), or when
    its agent, which outlives every other process of the job, is not running here and its
    controller stopped writing status (failed, or killed); an agent on another host is not
    seen from this one. The outcome: {"state": one of ENDED_STATES, "name", "steps": steps
    committed, "final_loss", "migrations" and "recoveries": {"done", "total", "downtimes"},
    "summary_path": summary.json or None, "events_path", "ended_by": for a failed job the
    event that ended it (its job_failed event, else the newest error event) or None,
    "summary": the summary or None}."""
    from trainmover.core import jobfile

    try:
        started = os.path.getmtime(os.path.join(run_dir, jobfile.RUN_FILE))
    except OSError:
        return None        # no run was started here (status says so its own way)
    summary, path = None, os.path.join(run_dir, "summary.json")
    try:
        # a summary older than the run's start (run.json: rewritten by each launch and
        # --resume) is the one of the run before a --resume
        if os.path.getmtime(path) >= started:
            with open(path) as f:
                summary = json.load(f)
    except (OSError, ValueError):
        pass
    if summary is None:
        # the controller writes the summary once the agent is gone: without one, the agent
        # says whether the job runs (a summary is trusted even where the agent's PID is
        # alive: after the job, that PID may be another process's)
        try:
            agent = jobfile.read_control(run_dir).get("agent_pid")
        except FileNotFoundError:
            agent = None   # the job failed before its agent started, or is starting
        except (OSError, ValueError):
            return None    # unreadable: status names the problem its own way
        if isinstance(agent, int) and pid_alive(agent):
            return None
        if read_status_file(run_dir, fresh_s) is not None:
            return None    # no summary yet, and a controller writing status: still running
    events = _run_events(run_dir)
    errors = [e for e in events if e.get("level") == "error"]
    # the event that ended the job is what to show: workers still exiting after it may log
    # their own errors later (every worker of a script failing before init does)
    ending = [e for e in errors if e.get("event") == "job_failed"]
    if summary is None and not ending and not os.path.exists(
            os.path.join(run_dir, jobfile.CONTROL_FILE)):
        return None        # starting: nothing ran yet, and nothing failed
    last = (ending or errors or [None])[-1] if summary is None else None
    state = "failed" if summary is None else "stopped" if summary.get("stopped") else \
        "finished"
    tail = _last_metric(run_dir)
    s = summary or {}
    if state == "finished":
        steps, loss = s.get("steps"), s.get("final_loss")
    else:
        steps = s.get("resume_step") if state == "stopped" else \
            (tail["step"] + 1 if tail else 0)
        loss = tail.get("loss") if tail else None
    migrations = s.get("migrations") if summary else \
        [e for e in events if e.get("event") in ("migration_done", "migration_aborted",
                                                 "migration_interrupted")]
    recoveries = s.get("recoveries") if summary else \
        [e for e in events if e.get("event") == "recovery_done"]
    return {"state": state, "name": s.get("name") or _job_name(run_dir), "steps": steps,
            "final_loss": loss, "migrations": _interruptions(migrations or []),
            "recoveries": _interruptions(recoveries or []),
            "summary_path": path if summary is not None else None,
            "events_path": os.path.join(run_dir, "events.jsonl"),
            "ended_by": last, "summary": summary}


def _run_events(run_dir: str) -> list[dict]:
    """The events of the current run: from its job_started on (events.jsonl keeps those of
    the runs before a --resume too; the file's order, not clocks, which may differ between
    the hosts writing the run dir)."""
    from trainmover.core.events import read_jsonl

    events = read_jsonl(os.path.join(run_dir, "events.jsonl"))
    starts = [i for i, e in enumerate(events) if e.get("event") == "job_started"]
    return events[starts[-1]:] if starts else events


def _last_metric(run_dir: str) -> dict | None:
    """The newest committed step's record in metrics.jsonl (from the file's tail)."""
    try:
        with open(os.path.join(run_dir, "metrics.jsonl"), "rb") as f:
            f.seek(0, os.SEEK_END)
            cut = max(0, f.tell() - METRICS_TAIL_BYTES)
            f.seek(cut)
            lines = f.read().split(b"\n")
    except OSError:
        return None
    for line in reversed(lines[1:] if cut else lines):   # the first may be cut by the seek
        try:
            record = json.loads(line)
        except ValueError:
            continue       # the torn last line of a crash
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            return record
    return None


def _job_name(run_dir: str) -> str | None:
    from trainmover.core import jobfile

    try:
        return jobfile.read_job(run_dir).name
    except (OSError, ValueError):
        return None


def _interruptions(items: list[dict]) -> dict:
    """Counts of migrations or recoveries, and each done one's downtime as a person reads it
    (``core/accounting.py``: one inside the step noise says so)."""
    from trainmover.core.accounting import downtime_value

    done = [x for x in items if x.get("status", "done") == "done"]
    return {"done": len(done), "total": len(items),
            "lost_steps": sum(x.get("lost_steps") or 0 for x in done),
            "downtimes": [downtime_value(x.get("downtime_s"), x.get("downtime_noise_s"))
                          for x in done]}


def _counts(what: str, c: dict) -> str:
    """"migrations: 2 done of 3, downtime 40.1 ms, no measurable stall (...)" (the newest
    three; the summary has every one)."""
    text = f"{what}: {c['done']} done of {c['total']}"
    if what == "recoveries":
        text += f", {c['lost_steps']} committed steps lost"
    if c["downtimes"]:
        more = len(c["downtimes"]) - 3
        text += ", downtime " + ", ".join(c["downtimes"][-3:]) + \
            (f" and {more} more in the summary" if more > 0 else "")
    return text


def render_ended(run_dir: str, outcome: dict) -> str:
    s, state = outcome["summary"] or {}, outcome["state"]
    name = repr(outcome.get("name") or "")
    loss = f", final loss {outcome['final_loss']:.4f}" \
        if outcome.get("final_loss") is not None else ""
    moves = _counts("migrations", outcome["migrations"]) + "\n" + \
        _counts("recoveries", outcome["recoveries"])
    if state == "failed":
        err = outcome["ended_by"]
        why = " (no error recorded: killed?)"
        if err:
            # a failure's message is its headline, then the last log lines of the worker
            # behind it: the headline and the last of those (where the script's own error is)
            text = str(err.get("error") or err.get("reason") or "").strip().splitlines()
            shown = text[:1] + (["  ..."] if len(text) > 4 else []) + text[1:][-3:]
            why = f"; ended by {err.get('event')}: " + "\n".join(shown)
        return (f"job {name} failed after {outcome['steps']} committed steps{loss}{why}\n"
                f"{moves}\nthe job is not running and left no summary (it failed or was "
                f"killed); events: {outcome['events_path']}; logs: {run_dir}/logs/; continue "
                f"from its newest checkpoint, if it has one, with `trainmover run --resume "
                f"{run_dir}`")
    if state == "stopped":
        return (f"job {name} stopped at step {s.get('resume_step')}{loss} "
                f"({s.get('reason', 'asked')}); continue with `trainmover run --resume "
                f"{run_dir}`\n{moves}\nsummary: {outcome['summary_path']}")
    lines = [f"job {name} finished: {outcome['steps']} steps{loss}"
             + f", {s.get('wall_s', 0):.1f} s"
             + (f" (mean step {s['mean_step_time_s'] * 1000:.1f} ms)"
                if s.get("mean_step_time_s") else "")]
    layout = s.get("layout") or {}
    lines.append(f"layout dp{layout.get('dp')}.pp{layout.get('pp')}.tp{layout.get('tp')}: "
                 f"{s.get('workers')} workers + {s.get('standbys')} standby")
    lines += [moves, f"stragglers: {len(s.get('stragglers') or [])}"]
    agree = s.get("replicas_agree")
    lines.append("replicas: " + {True: "agree", False: "DISAGREE (see replicas_disagree in "
                                 "events.jsonl)", None: "none to compare"}[agree])
    lines.append(f"weights_sha256 {s.get('weights_sha256')}; final checkpoint "
                 f"{s.get('checkpoint')}")
    lines.append(f"summary: {outcome['summary_path']}; events: {outcome['events_path']}")
    return "\n".join(lines)
