"""One table from two `trainmover bench step` runs of different commits (each run's
step.json): the median step of each strategy before and after, and the job's and the
engine's ratio over DDP in each (DDP, unchanged by trainmover, is the yardstick of how
loaded the machine was during each run).

    git worktree add /tmp/old <old commit>
    (cd /tmp/old && PYTHONPATH=. python -m trainmover bench step --repeats 3 --out /tmp/b_old)
    python -m trainmover bench step --repeats 3 --out /tmp/b_new
    python benchmarks/step_before_after.py /tmp/b_old /tmp/b_new --name store_step_before_after \
        --what "the authenticated store (before: TCPStore)"
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(folder: str) -> dict:
    with open(os.path.join(folder, "step.json")) as f:
        return json.load(f)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("before")
    p.add_argument("after")
    p.add_argument("--name", required=True, help="the result's file stem")
    p.add_argument("--what", required=True, help="what changed between the two commits")
    a = p.parse_args()
    runs = {"before": _load(a.before), "after": _load(a.after)}
    strategies = sorted({r["strategy"] for r in runs["before"]["rows"]})
    rows = []
    for strategy in strategies:
        row = {"strategy": strategy}
        for when, run in runs.items():
            times = [r["median_step_s"] * 1000 for r in run["rows"] if r["strategy"] == strategy]
            row[f"{when}_ms"] = round(statistics.median(times), 1)
            row[f"{when}_range_ms"] = f"{min(times):.1f}-{max(times):.1f}"
        rows.append(row)
    ratios = {when: {"job_over_ddp": round(1 + run["job_overhead_vs_ddp"], 3),
                     "engine_over_ddp": round(1 + run["overhead_vs_ddp"], 3),
                     "job_over_ddp_per_repeat": [round(x, 3) for x in run["per_repeat_job_ratio"]],
                     "engine_over_ddp_per_repeat": [round(x, 3) for x in run["per_repeat_ratio"]]}
              for when, run in runs.items()}
    out = {"benchmark": "step_before_after", "what": a.what,
           "commit": runs["after"]["commit"], "before_commit": runs["before"]["commit"],
           "command": ["python", "benchmarks/step_before_after.py", *sys.argv[1:]],
           "machine": runs["after"].get("machine"), "rows": rows, "ratios": ratios}
    lines = [f"# `bench step` before and after {a.what}: {runs['before']['commit']} -> "
             f"{runs['after']['commit']}", "",
             f"Each side: `trainmover bench step --repeats 3` ({runs['after']['recipe']}, "
             f"DP{runs['after']['layout'].get('dp')}, {runs['after']['steps']} steps, the first "
             f"{runs['after']['warmup_steps_excluded']} left out), run one after the other on "
             f"the same machine; median step of each strategy (min-max of the 3 repeats).", "",
             "| strategy | before (ms) | after (ms) |", "|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['strategy']} | {r['before_ms']} ({r['before_range_ms']}) | "
                     f"{r['after_ms']} ({r['after_range_ms']}) |")
    lines += ["", "Over DDP in the same run (DDP is the yardstick of the machine's load):", "",
              "| | before | after |", "|---|---|---|"]
    for key, label in (("job_over_ddp", "a whole job (`trainmover run`) over DDP"),
                       ("engine_over_ddp", "the engine's step over DDP")):
        b, f = ratios["before"], ratios["after"]
        lines.append(f"| {label} | {b[key]} ({min(b[key + '_per_repeat'])}-"
                     f"{max(b[key + '_per_repeat'])}) | {f[key]} ({min(f[key + '_per_repeat'])}-"
                     f"{max(f[key + '_per_repeat'])}) |")
    text = "\n".join(lines) + "\n"
    print(text)
    base = os.path.join(ROOT, "benchmarks", "results", a.name)
    with open(base + ".md", "w") as f:
        f.write(text)
    with open(base + ".json", "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
