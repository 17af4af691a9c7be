"""``trainmover bench soak`` (``make soak``): a job runs for many minutes while an outside
driver disrupts it every ~20 s, the way operations and hardware would: a worker killed
(SIGKILL) or stopped (SIGSTOP) at a random moment of its step, a planned migration, the
controller killed, a free standby killed. The standby pool is replenished with new processes
as standbys are used up. The driver samples the store's key count and every process's memory
as it goes, then runs the same job without events and compares.

Pass criteria (written to the report): every event handled (each killed or stopped worker
recovered, each migration done, each controller kill followed by a restarted controller);
every step committed exactly once in ``metrics.jsonl``; no recovery lost steps; final weights
equal to the uninterrupted run's; store keys at the end at most twice the count after the
first minute; agent and worker memory growth at most 10% within a role (after a process's
first minute in it: a standby promoted to a worker allocates the role's state once).

Kinds not driven from outside: a communicator error and a wedged main thread need a hook in
the process (they are covered by the test suite), and a host loss needs several hosts.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

from trainmover.bench.report import git_commit, machine_description, write_result
from trainmover.core.events import read_jsonl

KINDS = ("crash", "hang", "migrate", "controller", "standby")
# The driver waits for the job to be quiet (nothing in flight, a warm standby free) before
# the next event, at most this long; then it goes ahead anyway.
QUIET_WAIT_S = 60.0
SAMPLE_EVERY_S = 10.0


def soak_config(steps: int, standbys: int = 2):
    from trainmover.core.topology import Layout
    from trainmover.recipes import get_recipe

    cfg = get_recipe("tiny")
    cfg.layout = Layout(2, 2, 1)
    cfg.train.steps = steps
    cfg.train.threads_per_worker = 1
    cfg.override(standby_count=standbys, standby_replenish=True, standby_replenish_max=10_000,
                 controller_max_restarts=10_000, checkpoint_every=500)
    return cfg.validate()


def _run_child(config_path: str, run_dir: str) -> int:
    """The job's first controller, in its own process (so that the driver can kill it)."""
    from trainmover.control.coordinator import run_job
    from trainmover.core.config import JobConfig

    with open(config_path) as f:
        cfg = JobConfig.from_dict(json.load(f))
    run_job(cfg, run_dir, quiet=True)
    return 0


def _start(cfg, run_dir: str) -> subprocess.Popen:
    os.makedirs(os.path.dirname(run_dir), exist_ok=True)
    path = run_dir + ".config.json"
    with open(path, "w") as f:
        json.dump(cfg.to_dict(), f)
    log = open(run_dir + ".controller.log", "ab")
    return subprocess.Popen([sys.executable, "-m", "trainmover.bench.soak", "--child", path,
                             run_dir], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _wait_summary(run_dir: str, t_start: float, timeout_s: float) -> dict:
    path = os.path.join(run_dir, "summary.json")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if os.path.exists(path) and os.path.getmtime(path) >= t_start:
            time.sleep(0.5)   # written atomically? read after a beat either way
            with open(path) as f:
                return json.load(f)
        time.sleep(1.0)
    raise TimeoutError(f"no summary.json in {run_dir} within {timeout_s} s")


def _rss_mb(pid: int | None, field: str = "VmRSS") -> float | None:
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _calibrate(minutes: float, out_root: str) -> tuple[int, float]:
    """Steps that take about ``minutes`` without events, from a 150-step run."""
    from trainmover.control.coordinator import run_job

    cfg = soak_config(150)
    run_job(cfg, os.path.join(out_root, "calibrate"), quiet=True, timeout_s=600)
    records = read_jsonl(os.path.join(out_root, "calibrate", "metrics.jsonl"))
    times = sorted(r["time"] for r in records)
    step_s = (times[-1] - times[20]) / (len(times) - 21)
    return max(200, int(minutes * 60 / step_s)), step_s


class Driver:
    def __init__(self, run_dir: str, rng: random.Random, interval_s: float):
        from trainmover.control.client import connect

        self.run_dir, self.rng, self.interval_s = run_dir, rng, interval_s
        self.store = None
        self._connect = connect
        self.events: list[dict] = []
        self.samples: list[dict] = []
        self.peak: dict[str, float] = {}

    def status(self):
        from trainmover.control.status import read_status

        if self.store is None:
            self.store = self._connect(self.run_dir)
        return read_status(self.run_dir, self.store)

    def sample(self, t0: float, agent_pid: int) -> None:
        try:
            st = self.status()
        except Exception:  # noqa: BLE001 - between a controller's death and its snapshot
            return
        rss = {"agent": _rss_mb(agent_pid), "controller": _rss_mb(st.controller_pid)}
        roles = {}
        for p in st.workers + st.standbys:
            if p.alive:
                rss[p.name] = _rss_mb(p.pid)
                roles[p.name] = "standby" if p in st.standbys else "worker"
                hwm = _rss_mb(p.pid, "VmHWM")
                if hwm is not None:
                    self.peak[p.name] = max(self.peak.get(p.name, 0.0), hwm)
        self.samples.append({"t": round(time.time() - t0, 1), "step": st.committed_step,
                             "keys": st.store_keys,
                             "rss_mb": {k: round(v, 1) for k, v in rss.items() if v},
                             "roles": roles})

    def quiet(self, deadline: float):
        while time.monotonic() < deadline:
            try:
                st = self.status()
            except Exception:  # noqa: BLE001
                time.sleep(1.0)
                continue
            if st.migration_in_flight is None and st.recovery_in_flight is None and \
                    st.controller_alive and st.free_standbys() and \
                    all(w.alive for w in st.workers):
                return st
            time.sleep(0.5)
        return None

    def disrupt(self, st, t0: float) -> None:
        from trainmover.control.client import request_migration

        kind = self.rng.choice(KINDS)
        event = {"t": round(time.time() - t0, 1), "step": st.committed_step, "kind": kind}
        if kind in ("crash", "hang", "migrate"):
            victim = self.rng.choice(st.workers)
            event["target"] = victim.name
            if kind == "migrate":
                answer = request_migration(self.run_dir, [victim.name], wait=False)
                event["answer"] = answer.get("status")
            else:
                # at a random moment of its step: the driver's timing is not aligned to steps
                time.sleep(self.rng.uniform(0.0, 0.05))
                os.kill(victim.pid, signal.SIGKILL if kind == "crash" else signal.SIGSTOP)
        elif kind == "controller":
            event["target"] = f"controller pid {st.controller_pid}"
            os.kill(st.controller_pid, signal.SIGKILL)
            self.store = None   # reconnect: the store stays up (the agent hosts it)
        else:
            victim = self.rng.choice([s for s in st.standbys if s.alive])
            event["target"] = victim.name
            os.kill(victim.pid, signal.SIGKILL)
        self.events.append(event)
        print(f"  [{event['t']:7.1f} s] step {event['step']}: {kind} "
              f"{event.get('target', '')}", flush=True)


def _check(events: list[dict], summary: dict, run_dir: str, steps: int) -> dict:
    """What became of each event, read from the job's own records."""
    recovered = {w for r in summary.get("recoveries", []) if r.get("status") == "done"
                 for w in r["failures"]}
    log = read_jsonl(os.path.join(run_dir, "events.jsonl"))
    restarts = sum(1 for e in log if e["event"] == "controller_restarted")
    migrated = {p["leaver"]: m["status"] for m in summary.get("migrations", [])
                for p in m.get("pairs", [])}
    handled = []
    for e in events:
        if e["kind"] in ("crash", "hang"):
            ok = e["target"] in recovered
        elif e["kind"] == "migrate":
            # done; or ended by a failure that came first (then the recovery handled it)
            ok = migrated.get(e["target"]) in ("done", "interrupted", "aborted")
        elif e["kind"] == "controller":
            ok = True      # judged in total below
        else:
            ok = any(x["event"] == "standby_replenished" for x in log)
        handled.append(ok)
    controller_kills = sum(1 for e in events if e["kind"] == "controller")
    metrics = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    seen = [r["step"] for r in metrics]
    return {"handled": handled, "controller_restarts": restarts,
            "controller_kills": controller_kills,
            "steps_missing": sorted(set(range(steps)) - set(seen))[:20],
            "steps_twice": sorted({s for s in seen if seen.count(s) > 1})[:20],
            "lost_steps": sum(r.get("lost_steps") or 0 for r in summary.get("recoveries", []))}


def bench_soak(minutes: float, interval_s: float, seed: int, out_dir: str) -> dict:
    rng = random.Random(seed)
    root = tempfile.mkdtemp(prefix="tm-soak-")
    steps, step_s = _calibrate(minutes, root)
    print(f"soak: {steps} steps (~{step_s * 1000:.1f} ms/step without events), an event every "
          f"~{interval_s:.0f} s; run dirs under {root}", flush=True)
    cfg = soak_config(steps)
    run_dir = os.path.join(root, "soak")
    t0 = time.time()
    child = _start(cfg, run_dir)
    while not os.path.exists(os.path.join(run_dir, "control.json")):
        time.sleep(0.5)
        if child.poll() is not None:
            raise RuntimeError(f"the soak job did not start: see {run_dir}.controller.log")
    with open(os.path.join(run_dir, "control.json")) as f:
        agent_pid = json.load(f)["agent_pid"]
    driver = Driver(run_dir, rng, interval_s)
    from trainmover.core.proc import pid_alive

    next_event = time.monotonic() + interval_s
    next_sample = time.monotonic()
    while pid_alive(agent_pid):
        now = time.monotonic()
        if now >= next_sample:
            driver.sample(t0, agent_pid)
            next_sample = now + SAMPLE_EVERY_S
        if now >= next_event:
            st = driver.quiet(now + QUIET_WAIT_S)
            if st is not None and st.committed_step < steps - 200:
                try:
                    driver.disrupt(st, t0)
                except (OSError, ValueError, TypeError) as exc:
                    print(f"  event skipped: {exc}", flush=True)
            next_event = time.monotonic() + rng.uniform(0.75, 1.25) * interval_s
        time.sleep(0.2)
    wall_s = time.time() - t0
    summary = _wait_summary(run_dir, t0, 120)
    print(f"soak job ended after {wall_s:.0f} s; running it again without events", flush=True)
    from trainmover.control.coordinator import run_job

    base = run_job(soak_config(steps), os.path.join(root, "baseline"), quiet=True,
                   timeout_s=4 * 3600)
    checks = _check(driver.events, summary, run_dir, steps)
    first = next((s for s in driver.samples if s["t"] >= 60 and s["keys"]), None)
    last = next((s for s in reversed(driver.samples) if s["keys"]), None)

    def growth(series: list[tuple[float, float]]) -> float | None:
        """After the first minute of a process in one role (start-up, warm-up, or taking
        the role over), over the rest of its time in that role; None for less than two
        minutes. A standby promoted to a worker allocates its role's state, as a newly
        started worker does: that is a step up between roles, not growth within one."""
        after = [v for t, v in series if t >= series[0][0] + 60]
        if len(after) < 2 or series[-1][0] - series[0][0] < 120:
            return None
        return max(after) / after[0] - 1.0

    by_role: dict[str, list[tuple[float, float]]] = {}
    for s in driver.samples:
        for name, mb in s["rss_mb"].items():
            role = s.get("roles", {}).get(name)
            by_role.setdefault(name if role is None else f"{name} ({role})", []).append(
                (s["t"], mb))
    growths = {n: growth(series) for n, series in by_role.items()}
    worker_growth = [g for n, g in growths.items() if g is not None and n != "controller"]
    result = {
        "commit": git_commit(), "machine": machine_description(), "seed": seed,
        "minutes_planned": minutes, "wall_s": round(wall_s, 1), "steps": steps,
        "events": driver.events, "handled": checks["handled"],
        "events_total": len(driver.events), "events_handled": sum(checks["handled"]),
        "controller_kills": checks["controller_kills"],
        "controller_restarts": checks["controller_restarts"],
        "recoveries": len(summary.get("recoveries", [])),
        "migrations_done": sum(1 for m in summary.get("migrations", [])
                               if m["status"] == "done"),
        "steps_missing": checks["steps_missing"], "steps_twice": checks["steps_twice"],
        "lost_steps": checks["lost_steps"],
        "weights_equal": summary.get("weights_sha256") == base.get("weights_sha256"),
        "keys_after_1_min": first["keys"] if first else None,
        "keys_at_end": last["keys"] if last else None,
        "rss_growth": {k: None if v is None else round(v, 4) for k, v in growths.items()},
        "peak_rss_mb": {k: round(v, 1) for k, v in driver.peak.items()},
        "samples": driver.samples,
    }
    keys_ok = bool(first and last and last["keys"] <= 2 * first["keys"])
    rss_ok = bool(worker_growth) and max(worker_growth) <= 0.10
    result["passed"] = bool(
        result["events_handled"] == result["events_total"]
        and result["controller_restarts"] >= result["controller_kills"]
        and not result["steps_missing"] and not result["steps_twice"]
        and result["lost_steps"] == 0 and result["weights_equal"] and keys_ok and rss_ok)
    write_result(out_dir, "soak", result, _report(result, keys_ok, rss_ok))
    return result


def _max_growth(r: dict) -> float:
    return max([v for k, v in r["rss_growth"].items() if v is not None and k != "controller"]
               or [0.0])


def _report(r: dict, keys_ok: bool, rss_ok: bool) -> str:
    kinds = {k: sum(1 for e in r["events"] if e["kind"] == k) for k in KINDS}
    lines = [f"# Soak: {r['wall_s'] / 60:.1f} minutes, {r['events_total']} events "
             f"(commit {r['commit']})", "",
             "Tiny recipe, DP2 x PP2, 2 standbys replenished, one thread per worker, 2 cores. "
             "An event every ~20 s from outside the job (`trainmover bench soak`), seed "
             f"{r['seed']}: " + ", ".join(f"{n} {k}" for k, n in kinds.items()) + ".", "",
             f"**{'PASSED' if r['passed'] else 'FAILED'}**", "",
             "| check | result |", "|---|---|",
             f"| events handled | {r['events_handled']} / {r['events_total']} |",
             f"| controller kills / restarts | {r['controller_kills']} / "
             f"{r['controller_restarts']} |",
             f"| recoveries / migrations done | {r['recoveries']} / {r['migrations_done']} |",
             f"| steps missing / committed twice | {len(r['steps_missing'])} / "
             f"{len(r['steps_twice'])} |",
             f"| steps lost by recoveries | {r['lost_steps']} |",
             f"| final weights equal to the uninterrupted run | {r['weights_equal']} |",
             f"| store keys after 1 min / at the end | {r['keys_after_1_min']} / "
             f"{r['keys_at_end']} ({'ok' if keys_ok else 'over 2x'}) |",
             f"| memory growth after the first minute of each process in each role "
             f"(max, agent and workers)"
             f" | {_max_growth(r):+.1%} ({'ok' if rss_ok else 'over 10%'}) |", "",
             "Curve, one sample a minute (RSS in MiB):", "",
             "| minute | step | store keys | agent | controller | workers and standbys (min-max) |",
             "|---|---|---|---|---|---|"]
    minute = -1
    for s in r["samples"]:
        if int(s["t"] // 60) == minute:
            continue
        minute = int(s["t"] // 60)
        procs = [v for k, v in s["rss_mb"].items() if k not in ("agent", "controller")]
        lines.append(f"| {minute} | {s['step']} | {s['keys']} | {s['rss_mb'].get('agent', '-')} "
                     f"| {s['rss_mb'].get('controller', '-')} | "
                     + (f"{min(procs):.0f}-{max(procs):.0f}" if procs else "-") + " |")
    grown = sorted((v, k) for k, v in r["rss_growth"].items() if v is not None)
    lines += ["", "Memory growth after the first minute, per process and role: "
              + ", ".join(f"{k} {v:+.1%}" for v, k in reversed(grown)) + "."]
    lines += ["", "Events:", "", "| t (s) | step | kind | target | handled |",
              "|---|---|---|---|---|"]
    lines += [f"| {e['t']} | {e['step']} | {e['kind']} | {e.get('target', '')} | {ok} |"
              for e, ok in zip(r["events"], r["handled"])]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        sys.exit(_run_child(sys.argv[2], sys.argv[3]))
    raise SystemExit("usage: trainmover bench soak [--minutes M]")
