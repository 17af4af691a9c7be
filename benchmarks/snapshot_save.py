"""What encoding the controller's snapshot costs against the number of workers (issue #24):
the controller saves it every busy round (a migration or recovery in flight, or commands
to send), so its encoding is part of every such round. In the code of a source tree, at N
workers (DP = N/64 x PP8 x TP8, 8 standbys, 8 workers a host); run it once per tree (e.g.
`git worktree` checkouts of two commits) to compare them.

    PYTHONPATH=TREE python benchmarks/snapshot_save.py [--sizes 1024,...] [--repeats 5]

The state: the job context's parts that grow with N (the membership, the process table,
each process's host, each host's command counter) and a recovery's survivors' reports.
Timed, per size, the median (min-max) over REPEATS of ``SNAPSHOT_CODEC.dumps``:
- first: the first save of that state;
- unchanged: a save after only a number changed (the round's step);
- one process changed: a save after one process's record was replaced (an exit seen);
- one report came: a save after one more survivor's report was added;
- 1/16 of the reports came: a save after 1/16 of the workers' reports were added (a round
  of a recovery: in every part of the table);
- 1/16 of the processes changed: a save after every 16th process record was replaced;
- membership copied: a save after a migration's new membership (a copy of the old one,
  one worker replaced) took the old one's place.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

import trainmover
from trainmover.control.processes import AgentClient, ProcView
from trainmover.control.recovery import ActiveRecovery
from trainmover.control.snapshot_codec import SNAPSHOT_CODEC
from trainmover.core import codec
from trainmover.core import decisions as C
from trainmover.core import protocol as P
from trainmover.core.topology import Layout

PER_HOST = 8
# what the tree's job context keeps each process's host and each host's counter in
# (control/context.py): a Table where the tree has them, else a dict
CONTAINER = getattr(codec, "Table", dict)


def state_of(n: int) -> dict:
    layout = Layout(dp=n // 64, pp=8, tp=8)
    names = [f"w{i}" for i in range(n)]
    membership = C.Membership.initial(layout, names, [f"s{i}" for i in range(8)])
    procs = AgentClient(nnodes=n // PER_HOST)
    for i, w in enumerate(names):
        procs.procs[w] = ProcView(False, 1, i // PER_HOST, pid=10_000 + i)
    recovery = ActiveRecovery(1, 0, {}, 1.0, 5)
    for w in names[: n // 2]:
        recovery.reports[w] = P.FailureReport(6, "aborted", False, {})
    return {"membership": membership, "procs": procs, "step": 0, "recovery": recovery,
            "hosts": CONTAINER({w: i // PER_HOST for i, w in enumerate(names)}),
            "cmd_next": CONTAINER({str(h): 2 for h in range(n // PER_HOST)})}


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000


def measure(n: int) -> dict:
    state = state_of(n)
    first = timed(lambda: SNAPSHOT_CODEC.dumps(state))
    state["step"] += 1
    unchanged = timed(lambda: SNAPSHOT_CODEC.dumps(state))
    procs = state["procs"].procs
    procs["w5"] = dataclasses.replace(procs["w5"], code=1)
    proc = timed(lambda: SNAPSHOT_CODEC.dumps(state))
    state["recovery"].reports[f"w{n - 1}"] = P.FailureReport(6, "aborted", False, {})
    report = timed(lambda: SNAPSHOT_CODEC.dumps(state))
    # a round of a recovery: 1/16 of the survivors' reports came, in every part of the table
    for w in list(procs)[n // 2: n // 2 + n // 16]:
        state["recovery"].reports[w] = P.FailureReport(6, "aborted", False, {})
    reports = timed(lambda: SNAPSHOT_CODEC.dumps(state))
    # 1/16 of the process records replaced (PIDs learnt, exits seen in one round)
    for w in list(procs)[::16]:
        procs[w] = dataclasses.replace(procs[w], pid=procs[w].pid + 1)
    processes = timed(lambda: SNAPSHOT_CODEC.dumps(state))
    # a migration's or recovery's new membership: a copy, one worker replaced
    m = state["membership"].copy()
    m.workers["s0"] = m.workers.pop("w0")
    state["membership"] = m
    copied = timed(lambda: SNAPSHOT_CODEC.dumps(state))
    size = len(SNAPSHOT_CODEC.dumps(state))
    return {"first_ms": first, "unchanged_ms": unchanged, "one_process_ms": proc,
            "one_report_ms": report, "reports_ms": reports, "processes_ms": processes,
            "membership_copy_ms": copied, "bytes": size}


def cell(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1024,4096,16384,65536")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=os.path.dirname(trainmover.__file__)).stdout.strip()
    print(f"commit {commit}")
    print("| workers | snapshot (MB) | first (ms) | unchanged (ms) | one process changed (ms) "
          "| one report came (ms) | 1/16 of the reports came (ms) | 1/16 of the processes "
          "changed (ms) | membership copied (ms) |\n|---|---|---|---|---|---|---|---|---|")
    rows = []
    keys = ("first_ms", "unchanged_ms", "one_process_ms", "one_report_ms", "reports_ms",
            "processes_ms", "membership_copy_ms")
    for n in (int(s) for s in args.sizes.split(",")):
        runs = [measure(n) for _ in range(args.repeats)]
        row = {"workers": n, "bytes": runs[0]["bytes"],
               **{k: [r[k] for r in runs] for k in keys}}
        rows.append(row)
        print(f"| {n} | {row['bytes'] / 1e6:.1f} | " +
              " | ".join(cell(row[k]) for k in keys) + " |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"commit": commit, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
