"""One table from `trainmover bench control` runs of different commits (each run's JSON), in
the order given (e.g. before, after, before, after: runs alternated on one machine).

    python benchmarks/control_before_after.py A.json B.json A2.json B2.json \
        --labels before,after,before,after --name control_relays --out benchmarks/results \
        --what "aborts and commands relayed by the agents"

Each cell: the median (min-max) over the repeats of that size of every run of that label."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trainmover.bench.report import write_result  # noqa: E402

COLUMNS = [("vote_p50_ms", "step overhead p50 (ms)", 1), ("vote_p99_ms", "p99 (ms)", 1),
           ("root_store_rps", "root store req/s", 0),
           ("recovery_store_rps", "req/s in recovery", 0),
           ("store_connections", "store sockets", 0),
           ("sim_descriptors", "simulator descriptors", 0),
           ("controller_round_ms", "controller round p50 (ms)", 1),
           ("controller_round_p99_ms", "round p99 (ms)", 1),
           ("controller_round_max_ms", "round max (ms)", 1),
           ("controller_round_cpu_ms", "round CPU p50 (ms)", 1),
           ("controller_round_cpu_p99_ms", "round CPU p99 (ms)", 1),
           ("controller_cpu_share", "controller CPU", 2),
           ("crash_to_plan_s", "crash to plan (s)", 2),
           ("crash_to_resumed_s", "crash to resumed (s)", 2),
           ("sim_cpu_share", "simulator CPU", 2)]


def _cell(values: list[float], digits: int) -> str:
    med = statistics.median(values)
    return f"{med:.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("runs", nargs="+", help="bench control result JSON files")
    p.add_argument("--labels", required=True, help="comma list, one per run")
    p.add_argument("--name", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--what", required=True, help="what changed between the commits")
    args = p.parse_args()
    labels = args.labels.split(",")
    if len(labels) != len(args.runs):
        raise SystemExit(f"--labels {args.labels!r}: {len(labels)} labels for "
                         f"{len(args.runs)} runs")
    runs = []
    for path, label in zip(args.runs, labels):
        with open(path) as f:
            runs.append((label, json.load(f)))
    sizes = sorted({r["workers"] for _, run in runs for r in run["results"]})
    lines = [f"# `bench control` before and after: {args.what}", "",
             "Runs in this order on one machine, each `" + runs[0][1]["command"].split(
                 " --name")[0] + "` (median (min-max) over its repeats):", ""]
    for label, run in runs:
        lines.append(f"- {label}: commit {run['commit']}: `{run['command']}`")
    lines += ["", "| workers | run | " + " | ".join(c[1] for c in COLUMNS) + " |",
              "|---|---|" + "---|" * len(COLUMNS)]
    rows = []
    # the runs of one label (alternated with the others') are one row: medians over all
    # their repeats
    groups: dict[str, list[dict]] = {}
    for label, run in runs:
        groups.setdefault(label, []).append(run)
    for n in sizes:
        for label, group in groups.items():
            reps = [r for run in group for r in run["results"] if r["workers"] == n]
            if not reps:
                continue
            commits = ",".join(dict.fromkeys(run["commit"] for run in group))
            cells = {key: [r[key] for r in reps if r.get(key) is not None]
                     for key, _, _ in COLUMNS}
            lines.append(f"| {n} | {label} ({commits}, {len(reps)} runs) | " + " | ".join(
                _cell(cells[key], d) if cells[key] else "-" for key, _, d in COLUMNS) + " |")
            rows.append({"workers": n, "label": label, "commit": commits, "runs": len(reps),
                         **{key: statistics.median(v) for key, v in cells.items() if v}})
    result = {"benchmark": "control_before_after", "what": args.what,
              "runs": [{"label": label, "commit": run["commit"], "command": run["command"]}
                       for label, run in runs], "rows": rows}
    write_result(args.out, args.name, result, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
