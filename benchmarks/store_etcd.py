"""What the store on etcd costs a job, against the built-in store (issue #24 item 5): the
same job (the tiny recipe, DP2 x PP2, two standbys, steps of a few tens of ms, where the
store's share of a step is largest) with a planned migration of w0 at step 10 and a crash
of w1 at step 28, on each store, ``--repeats`` times in ABBA order. Per store: the interval
between committed steps before the migration (median of steps 2-9), the migration's and
the recovery's downtime as the job reports them, whether the weights equal across stores,
and the CPU the three etcd members spent (their /proc times, one machine's two cores
shared with the job).

    .venv/bin/python benchmarks/store_etcd.py [--repeats 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from trainmover.bench.etcd_cluster import EtcdCluster   # noqa: E402
from trainmover.bench.report import (fmt_spread, git_commit, machine_description,  # noqa: E402
                                     spread, write_result)
from trainmover.cli import apply_worker_faults   # noqa: E402
from trainmover.control.coordinator import run_job   # noqa: E402
from trainmover.core.events import read_jsonl   # noqa: E402
from trainmover.core.faults import Inject   # noqa: E402
from trainmover.core.topology import Layout   # noqa: E402
from trainmover.recipes import get_recipe   # noqa: E402

STEPS = 40


def job(etcd: str = ""):
    cfg = get_recipe("tiny")
    cfg.layout = Layout(2, 2, 1)
    cfg.train.steps = STEPS
    cfg.train.threads_per_worker = 1
    cfg.override(standby_count=2, health_heartbeat_timeout_s=5.0,
                 recovery_report_timeout_s=10.0)
    cfg.process.etcd = etcd
    apply_worker_faults(cfg, [Inject("crash", 28, "w1", "allreduce")])
    return cfg.validate()


def cpu_s(pids: list[int]) -> float:
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])      # utime, stime
    return total / tick


def one_run(store: str, cluster: EtcdCluster, run_dir: str) -> dict:
    members = [p.pid for p in cluster.procs]
    before = cpu_s(members)
    summary = run_job(job(cluster.address() if store == "etcd" else ""), run_dir,
                      quiet=True, timeout_s=600, injects=[Inject("migrate", 10, "w0")])
    metrics = [m for m in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
               if m["epoch"] == 0]          # one worker writes them (the loss's)
    times = {m["step"]: m["time"] for m in metrics}
    gaps = [times[s + 1] - times[s] for s in range(2, 9) if s in times and s + 1 in times]
    mig = [m for m in summary["migrations"] if m["status"] == "done"]
    rec = [r for r in summary["recoveries"] if r["status"] == "done"]
    return {"store": store, "step_interval_s": statistics.median(gaps),
            "migration_downtime_s": mig[0]["downtime_s"] if mig else None,
            "recovery_downtime_s": rec[0]["downtime_s"] if rec else None,
            "weights_sha256": summary["weights_sha256"], "wall_s": summary["wall_s"],
            "etcd_cpu_s": cpu_s(members) - before}


def table(r: dict) -> str:
    m = r["machine"]
    lines = [f"# The store on etcd vs the built-in store: one job on each, {r['repeats']} "
             f"repeats (median (min-max))", "",
             f"command: `{r['command']}`; commit {r['commit']}; machine: {m['cpu']}, "
             f"{m['cores']} cores, torch {m['torch']}", "",
             "| store | step interval (ms) | planned migration downtime (s) | crash "
             "recovery downtime (s) | job wall (s) | etcd members' CPU (s) | runs |",
             "|---|---|---|---|---|---|---|"]
    def cell(values: list[float], scale: float = 1.0, digits: int = 3) -> str:
        return fmt_spread(spread([v * scale for v in values]) if values else None, digits)

    for c in r["cells"]:
        lines.append(f"| {c['store']} | {cell(c['step_interval_s'], 1000, 1)} | "
                     f"{cell(c['migration_downtime_s'])} | {cell(c['recovery_downtime_s'])} | "
                     f"{cell(c['wall_s'], digits=1)} | {cell(c['etcd_cpu_s'], digits=1)} | "
                     f"{c['runs']} |")
    lines += ["", f"Weights equal across stores and repeats: {r['weights_equal']}.", "",
              "How to read it: " + __doc__.split("\n\n")[0].replace("\n", " ") +
              " The etcd members run on the same two cores as the job (three of them, "
              "heartbeats every 50 ms), so the etcd rows carry their CPU as well as their "
              "round trips; the built-in rows' members' CPU is what an idle cluster costs."]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = ap.parse_args()
    scratch = tempfile.mkdtemp(prefix="tm-store-etcd-")
    cluster = EtcdCluster(Path(scratch) / "etcd").start()
    result = {"benchmark": "store_etcd", "repeats": args.repeats,
              "command": f"python benchmarks/store_etcd.py --repeats {args.repeats}",
              "commit": git_commit(), "machine": machine_description(), "runs": []}
    try:
        for rep in range(args.repeats):
            order = ("builtin", "etcd") if rep % 2 == 0 else ("etcd", "builtin")
            for store in order:
                run = {"repeat": rep, **one_run(store, cluster,
                                               os.path.join(scratch, f"{store}-{rep}"))}
                print(run, flush=True)
                result["runs"].append(run)
    finally:
        cluster.stop()
    result["cells"] = []
    for store in ("builtin", "etcd"):
        runs = [r for r in result["runs"] if r["store"] == store]
        result["cells"].append({"store": store, "runs": len(runs), **{
            k: [r[k] for r in runs if r[k] is not None]
            for k in ("step_interval_s", "migration_downtime_s", "recovery_downtime_s",
                      "wall_s", "etcd_cpu_s")}})
    result["weights_equal"] = len({r["weights_sha256"] for r in result["runs"]}) == 1
    write_result(args.out, "store_etcd", result, table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
