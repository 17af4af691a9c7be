"""The same `trainmover bench downtime` cells from two source trees, interleaved, in one table:
did a change regress planned-migration or crash downtime?

    python benchmarks/compare_downtime.py --before /tmp/before --after . --repeats 3

Each tree runs as its own package (PYTHONPATH=<tree>), one cell at a time, alternating
trees (ABBA order over the repeats) so a slow phase of the machine hits both alike. The
figure per cell is the median over repeats with min and max; a ratio whose repeats
straddle 1 is "no measurable difference".
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def run_cell(tree: str, scenario: str, workers: int, compile_: bool, scratch: str) -> dict:
    out = os.path.join(scratch, f"{os.path.basename(os.path.abspath(tree))}-{scenario}.json")
    cmd = [sys.executable, "-m", "trainmover", "bench", "downtime", "--workers", str(workers),
           "--strategies", "trainmover", "--scenarios", scenario, "--repeats", "1",
           "--json", out,
           "--out", os.path.join(scratch, "tables")]
    if not compile_:
        cmd.append("--no-compile")
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    # run inside the tree: `python -m` puts the working directory first on sys.path, ahead
    # of PYTHONPATH, so from another checkout every cell would run that checkout's code
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800,
                         cwd=os.path.abspath(tree))
    if res.returncode != 0:
        raise RuntimeError(f"{tree} {scenario}: {res.stderr[-2000:]}")
    with open(out) as f:
        rows = json.load(f)["results"]
    (row,) = [r for r in rows if r["scenario"] == scenario and r["strategy"] == "trainmover"]
    return row


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--before", required=True)
    p.add_argument("--after", required=True)
    p.add_argument("--before-label", default="before")
    p.add_argument("--after-label", default="after")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--scenarios", default="planned,crash")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--name", default="downtime-before-after")
    args = p.parse_args()
    trees = {args.before_label: args.before, args.after_label: args.after}
    scratch = tempfile.mkdtemp(prefix="tm-compare-")
    cells: dict[str, dict[str, list]] = {}
    for rep in range(args.repeats):
        order = list(trees) if rep % 2 == 0 else list(reversed(trees))
        for scenario in args.scenarios.split(","):
            for label in order:
                row = run_cell(trees[label], scenario, args.workers, args.compile, scratch)
                cells.setdefault(scenario, {}).setdefault(label, []).append(row)
                print(f"  repeat {rep + 1} {scenario:>8} {label:>8}: downtime "
                      f"{row['downtime_s']}", flush=True)
    result = {"workers": args.workers, "compile": args.compile, "repeats": args.repeats,
              "trees": {k: os.path.abspath(v) for k, v in trees.items()}, "cells": {}}
    lines = [f"# bench downtime before/after ({args.workers} workers, "
             f"compile={args.compile}, {args.repeats} interleaved repeats, strategy trainmover)",
             "", "Trees: " + ", ".join(f"{k} = {_describe(v)}" for k, v in trees.items()), "",
             "| scenario | tree | downtime median (s) | min | max | after / before |",
             "|---|---|---|---|---|---|"]
    for scenario, by_label in cells.items():
        stats = {}
        for label, rows in by_label.items():
            d = [r["downtime_s"] for r in rows if r["downtime_s"] is not None]
            stats[label] = {"median": statistics.median(d), "min": min(d), "max": max(d),
                            "runs": d}
        b, a = stats[args.before_label], stats[args.after_label]
        ratio = a["median"] / b["median"]
        straddle = a["min"] <= b["max"] and b["min"] <= a["max"]
        verdict = "no measurable difference" if straddle else f"{ratio:.2f}x"
        result["cells"][scenario] = {"stats": stats, "ratio": ratio, "verdict": verdict}
        for label in (args.before_label, args.after_label):
            s = stats[label]
            lines.append(f"| {scenario} | {label} | {s['median']:.3f} | {s['min']:.3f} | "
                         f"{s['max']:.3f} | " + (f"{ratio:.2f} ({verdict})"
                                                  if label == args.after_label else "") + " |")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.name}.json"), "w") as f:
        json.dump(result, f, indent=2)
    with open(os.path.join(args.out, f"{args.name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def _describe(tree: str) -> str:
    try:
        rev = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
        # the code only: benchmark results written into the tree are not a change of it
        dirty = subprocess.run(["git", "-C", tree, "status", "--porcelain", "--", "trainmover"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return f"commit {rev}" + (" + uncommitted code changes" if dirty else "")
    except OSError:
        return tree


if __name__ == "__main__":
    sys.exit(main())
