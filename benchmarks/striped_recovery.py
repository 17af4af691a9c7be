"""A crash recovered from one data-parallel replica against the same recovery striped over two
(``recovery.stripe_sources``, issue #23 item 4): DP3 of the built-in trainer sized to the
state of ``--sizes`` (as ``bench state-size`` sizes it), one warm standby, w1 SIGKILLed from
outside once the standby is warm (``bench downtime``'s ``_failure_run``), ``--repeats``
fresh jobs per cell. Per cell: the recovery's downtime (SIGKILL to the first step committed
after it), the joiner's receive of the state (event ``state_received``: from its first
header to the state complete) and the bytes each replica sent.

    .venv/bin/python benchmarks/striped_recovery.py [--sizes 100,500] [--repeats 3]

What to expect where: on a cluster each replica sends over its own link, so k sources give
k times the bandwidth; here every process shares one machine's two cores and loopback, where
the copies themselves are the cost: this measures the mechanism's overhead and what
parallel senders give on this machine, not a network's gain.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from trainmover.bench.downtime import _failure_run   # noqa: E402
from trainmover.bench.report import (fmt_spread, git_commit, machine_description,  # noqa: E402
                                     spread, write_result)
from trainmover.bench.state_size import job_config, size_model, state_bytes_of  # noqa: E402
from trainmover.core.config import JobConfig   # noqa: E402
from trainmover.core.events import read_jsonl   # noqa: E402
from trainmover.core.topology import Layout   # noqa: E402

EVENT_STEP = 6
VICTIM = "w1"


def dp3(size_mb: float, sources: int) -> JobConfig:
    cfg = job_config(size_model(size_mb))
    cfg.layout = Layout(3, 1, 1)
    cfg.train.global_batch = 3            # one sequence per replica and step, as in DP2
    cfg.recovery.stripe_sources = sources
    return cfg.validate()


def one_run(size_mb: float, sources: int, run_dir: str) -> dict:
    res = _failure_run("trainmover", "crash", dp3(size_mb, sources), EVENT_STEP, VICTIM,
                       run_dir)
    events = read_jsonl(os.path.join(run_dir, "events.jsonl"))
    got = [e for e in events if e["event"] == "state_received"]
    sent = {e["worker"]: e["sent_bytes"] for e in events
            if e["event"] == "recovered" and e.get("sent_bytes")}
    out = {"downtime_s": res["downtime_s"], "detection_s": res.get("detection_latency_s"),
           "receive_s": got[0]["seconds"] if got else None,
           "bytes": got[0]["bytes"] if got else None,
           "sources": got[0]["sources"] if got else None, "sent_bytes": sent}
    shutil.rmtree(os.path.join(run_dir, "final"), ignore_errors=True)
    return out


def table(r: dict) -> str:
    m = r["machine"]
    lines = [f"# Striped recovery: a crash recovered from one replica vs from two (DP3, "
             f"{r['repeats']} repeats, median (min-max))", "",
             f"command: `{r['command']}`; commit {r['commit']}; machine: {m['cpu']}, "
             f"{m['cores']} cores, torch {m['torch']}", "",
             "| state (MB) | sources | downtime (s) | joiner receive (s) | MB from each "
             "replica | runs |", "|---|---|---|---|---|---|"]
    for c in r["cells"]:
        sent = " / ".join(f"{b / 1e6:.1f}" for b in c["sent_mb_example"]) or "-"
        lines.append(f"| {c['state_bytes'] / 1e6:.1f} | {c['sources']} | "
                     f"{fmt_spread(c['downtime_s'])} | {fmt_spread(c['receive_s'])} | "
                     f"{sent} | {c['runs']} |")
    lines += ["", "What to expect where: " +
              __doc__.split("What to expect where: ")[1].strip().replace("\n", " ")]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="100,500")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = ap.parse_args()
    scratch = tempfile.mkdtemp(prefix="tm-striped-")
    result = {"benchmark": "striped_recovery", "repeats": args.repeats,
              "command": f"python benchmarks/striped_recovery.py --sizes {args.sizes} "
                         f"--repeats {args.repeats}",
              "commit": git_commit(), "machine": machine_description(), "cells": [],
              "runs": []}
    for size_mb in [float(s) for s in args.sizes.split(",")]:
        for sources in (1, 2):
            runs = []
            for rep in range(args.repeats):
                run_dir = os.path.join(scratch, f"{size_mb:g}-{sources}-r{rep}")
                run = {"size_mb": size_mb, "stripe_sources": sources, "repeat": rep,
                       **one_run(size_mb, sources, run_dir)}
                print(run, flush=True)
                runs.append(run)
                result["runs"].append(run)
            ok = [r for r in runs if r["downtime_s"] is not None]
            result["cells"].append({
                "size_mb": size_mb, "sources": sources, "runs": len(ok),
                "state_bytes": state_bytes_of(size_model(size_mb)),
                "downtime_s": spread([r["downtime_s"] for r in ok]) if ok else None,
                "receive_s": spread([r["receive_s"] for r in ok if r["receive_s"]])
                if any(r["receive_s"] for r in ok) else None,
                "sent_mb_example": sorted(ok[0]["sent_bytes"].values()) if ok else []})
            write_result(args.out, "striped_recovery", result, table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
