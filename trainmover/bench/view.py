"""``bench view``: what watching a job costs it (target: the dashboard and metrics at most 1%
of step time), and how fast its status answers (target: at most 1 s).

Each repeat runs the same job twice, in rotating order: without a dashboard, and with one
polled as an open page and a Prometheus scraper would (``/api/state`` and ``/metrics``, each
every ``dashboard.refresh_s``, from a process of their own). The figure is the job's median commit-to-commit step time
(metrics.jsonl, warm-up steps left out), compared within each repeat. Status latency: while
the watched job runs, the page's ``/api/state`` and ``read_status`` through the store (what
``trainmover status`` falls back to while the controller is down) are timed each round;
``trainmover status`` as a command (Python start-up and imports included; it reads the
controller's status.json) is timed once per repeat.
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

from trainmover.bench.report import git_commit, machine_description, spread, write_result
from trainmover.core.events import read_jsonl
from trainmover.core.topology import Layout
from trainmover.recipes import get_recipe

SKIP = 5   # warm-up steps left out


def _get(url: str, token: str) -> float:
    t = time.perf_counter()
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        r.read()
    return time.perf_counter() - t


def poll_main(url: str, token: str, run_dir: str, period_s: float, stop_path: str,
              out_path: str) -> None:
    """The watcher, in a process of its own as a browser and a scraper would be: every
    ``period_s`` the page's state, the metrics and the status (as ``trainmover status``
    reads it when the controller's file is stale: through the store), timed, until
    ``stop_path`` exists; the timings go to ``out_path`` as JSON."""
    import json

    from trainmover.control.client import connect
    from trainmover.control.status import read_status

    timings: dict[str, list[float]] = {"api_state_s": [], "metrics_s": [], "read_status_s": []}
    store = connect(run_dir)
    while not os.path.exists(stop_path):
        time.sleep(period_s)
        try:
            timings["api_state_s"].append(_get(url + "api/state", token))
            timings["metrics_s"].append(_get(url + "metrics", token))
            t = time.perf_counter()
            read_status(run_dir, store)
            timings["read_status_s"].append(time.perf_counter() - t)
        except Exception:  # noqa: BLE001 - the job ended between two polls
            break
    with open(out_path, "w") as f:
        json.dump(timings, f)


def _run(cfg, watched: bool, timeout_s: float) -> dict:
    import json

    from trainmover.api import Job

    cfg = type(cfg).from_dict(cfg.to_dict())
    cfg.dashboard.port = 0 if watched else None
    timings: dict[str, list[float]] = {"api_state_s": [], "metrics_s": [], "read_status_s": []}
    with tempfile.TemporaryDirectory(prefix="tm-bench-view-") as scratch:
        run_dir = os.path.join(scratch, "run")
        stop, out = os.path.join(scratch, "stop"), os.path.join(scratch, "timings.json")
        job = Job(cfg.validate(), run_dir, timeout_s=timeout_s).start()
        command_s, poller = None, None
        if watched:
            board = job.dashboard
            poller = subprocess.Popen([sys.executable, "-c", (
                "from trainmover.bench.view import poll_main; "
                f"poll_main({board.url!r}, {board.token!r}, {run_dir!r}, "
                f"{cfg.dashboard.refresh_s!r}, {stop!r}, {out!r})")])
            time.sleep(3 * cfg.dashboard.refresh_s)
            t = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "trainmover", "status", "--run-dir",
                                   run_dir, "--json"], capture_output=True, timeout=120)
            if proc.returncode == 0:
                command_s = time.perf_counter() - t
        job.wait(timeout_s)
        if poller is not None:
            open(stop, "w").close()
            poller.wait(60)
            if os.path.exists(out):
                with open(out) as f:
                    timings = json.load(f)
        records = sorted(read_jsonl(os.path.join(run_dir, "metrics.jsonl")),
                         key=lambda r: r["step"])
    gaps = [r["time"] - p["time"] for p, r in zip(records, records[1:]) if r["step"] >= SKIP]
    return {"watched": watched, "median_step_s": statistics.median(gaps),
            "steps_timed": len(gaps), "status_command_s": command_s,
            **{k: statistics.median(v) if v else None for k, v in timings.items()},
            "polls": len(timings["api_state_s"])}



def bench_view(steps: int = 300, repeats: int = 3, recipe: str = "demo",
               out_dir: str = "benchmarks/results", timeout_s: float = 900.0) -> dict:
    if repeats < 3:
        raise ValueError(f"--repeats {repeats}: at least 3 (a median with its spread)")
    if steps <= SKIP + 20:
        raise ValueError(f"--steps {steps} must exceed {SKIP + 20}")
    cfg = get_recipe(recipe)
    cfg.layout = Layout(2, 2, 1)
    cfg.train.steps = steps
    cfg.standby.count = 1
    cfg.train.threads_per_worker = 1
    runs = []
    for k in range(repeats):
        pair = {}
        for watched in ([False, True] if k % 2 == 0 else [True, False]):
            pair[watched] = _run(cfg, watched, timeout_s)
            print(f"repeat {k + 1}/{repeats} {'watched' if watched else 'plain  '}: "
                  f"median step {pair[watched]['median_step_s'] * 1000:.1f} ms", flush=True)
        runs.append({"plain": pair[False], "watched": pair[True],
                     "ratio": pair[True]["median_step_s"] / pair[False]["median_step_s"]})
    ratios = [r["ratio"] for r in runs]
    plain = [r["plain"]["median_step_s"] for r in runs]
    plain_spread = (max(plain) - min(plain)) / statistics.median(plain)
    cost = statistics.median(ratios) - 1.0
    watched = [r["watched"] for r in runs]

    def col(key):
        xs = [w[key] for w in watched if w[key] is not None]
        return spread(xs) if xs else None

    result = {
        "commit": git_commit(), "machine": machine_description(), "recipe": recipe,
        "layout": "DP2 x PP2 x TP1", "steps": steps, "repeats": repeats, "runs": runs,
        "step_cost": {**spread([x - 1.0 for x in ratios]),
                      "plain_step_spread": plain_spread,
                      "verdict": "no measurable difference" if abs(cost) <= plain_spread
                      else ("within the 1% target" if cost <= 0.01 else "over the 1% target")},
        "api_state_s": col("api_state_s"), "metrics_s": col("metrics_s"),
        "read_status_s": col("read_status_s"), "status_command_s": col("status_command_s"),
    }
    table = _table(result)
    write_result(out_dir, "view", result, table)
    return result


def _table(r: dict) -> str:
    def ms(s):
        return "-" if s is None else \
            f"{s['median'] * 1000:.1f} ms ({s['min'] * 1000:.1f}-{s['max'] * 1000:.1f})"

    c = r["step_cost"]
    lines = [
        "# What watching a job costs it", "",
        f"Commit {r['commit']}; {r['layout']}, recipe `{r['recipe']}`, {r['steps']} steps, "
        f"{r['repeats']} repeats (median, min-max). Watched: the controller serves the "
        f"dashboard, polled every second for `/api/state` and `/metrics` (an open page and "
        f"a 1 s Prometheus scrape) by another process; the controller also rewrites "
        f"status.json every second in both.", "",
        "| figure | value |", "|---|---|",
        f"| step time, watched / plain - 1 | {c['median'] * 100:+.2f}% "
        f"({c['min'] * 100:+.2f}% to {c['max'] * 100:+.2f}%) |",
        f"| spread of the plain runs' step time | {c['plain_step_spread'] * 100:.1f}% |",
        f"| verdict | {c['verdict']} |",
        f"| `/api/state` answer | {ms(r['api_state_s'])} |",
        f"| `/metrics` answer | {ms(r['metrics_s'])} |",
        f"| status read through the store (`read_status`, connected) | "
        f"{ms(r['read_status_s'])} |",
        f"| `trainmover status --json` command, start to exit | {ms(r['status_command_s'])} |",
        "", "Per repeat (median step ms, plain / watched):", "",
    ]
    lines += [f"- {i + 1}: {x['plain']['median_step_s'] * 1000:.1f} / "
              f"{x['watched']['median_step_s'] * 1000:.1f} ({x['watched']['polls']} polls)"
              for i, x in enumerate(r["runs"])]
    return "\n".join(lines) + "\n"
