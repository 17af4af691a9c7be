"""``bench sources``: what a crash costs with each recovery source, side by side in one run:

- ``replica``: DP2 x PP2; the failed role's state comes from its live data-parallel replica
  (no step lost);
- ``snapshot``: DP1 x PP2; every role rolls back to the newest in-memory peer snapshot
  (taken every ``K`` steps), fetched from the agent's memory;
- ``checkpoint``: DP1 x PP2 with snapshots off; every role rolls back to the newest disk
  checkpoint (taken every ``K`` steps, the same interval).

The victim (the first stage's dp0 worker) is killed at the start of step ``crash_step``.
Figures per repeat (cells interleaved over the repeats): the downtime (the fault to the first
committed step after it, as the controller accounts it), the steps lost (replayed), and the
total cost, downtime plus the lost steps at the run's median step time. Each run's final
weights are checked against the same job without the crash."""
from __future__ import annotations

import os
import statistics
import tempfile

from trainmover.bench.report import git_commit, machine_description, spread, write_result
from trainmover.core.faults import Inject, worker_faults
from trainmover.core.topology import Layout
from trainmover.recipes import get_recipe

CELLS = ("replica", "snapshot", "checkpoint")


def _cfg(cell: str, steps: int, every: int, recipe: str):
    cfg = get_recipe(recipe)
    cfg.layout = Layout(2 if cell == "replica" else 1, 2, 1)
    cfg.train.steps = steps
    cfg.train.threads_per_worker = 1
    cfg.override(standby_count=1, checkpoint_every=every if cell == "checkpoint" else 0,
                 snapshot_every=every if cell == "snapshot" else 0)
    return cfg.validate()


def _run(cfg, crash_step: int | None) -> dict:
    from trainmover.control.coordinator import run_job
    from trainmover.core.events import read_jsonl

    cfg = type(cfg).from_dict(cfg.to_dict())
    if crash_step is not None:
        cfg.faults = list(cfg.faults) + worker_faults([Inject("crash", crash_step, "w0",
                                                              "forward")])
    with tempfile.TemporaryDirectory(prefix="tm-bench-sources-") as scratch:
        run_dir = os.path.join(scratch, "run")
        summary = run_job(cfg, run_dir, quiet=True, timeout_s=900)
        records = {r["step"]: r for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))}
    times = [records[s]["time"] - records[s - 1]["time"] for s in sorted(records)[5:]
             if s - 1 in records]
    return {"summary": summary, "median_step_s": statistics.median(times)}



def bench_sources(repeats: int = 3, steps: int = 60, every: int = 10, crash_step: int = 27,
                  recipe: str = "demo", out_dir: str = "benchmarks/results") -> dict:
    if not 0 < crash_step < steps - 5:
        raise ValueError(f"--crash-step {crash_step} must be inside 1..{steps - 6}")
    baselines = {c: _run(_cfg(c, steps, every, recipe), None)["summary"]["weights_sha256"]
                 for c in CELLS}
    rows: dict[str, list[dict]] = {c: [] for c in CELLS}
    for rep in range(repeats):
        for cell in CELLS[rep % len(CELLS):] + CELLS[:rep % len(CELLS)]:
            out = _run(_cfg(cell, steps, every, recipe), crash_step)
            (rec,) = out["summary"]["recoveries"]
            row = {"downtime_s": rec["downtime_s"], "lost_steps": rec["lost_steps"],
                   "median_step_s": out["median_step_s"],
                   "source": sorted(set(rec["sources"].values())),
                   "weights_equal": out["summary"]["weights_sha256"] == baselines[cell]}
            row["total_s"] = row["downtime_s"] + row["lost_steps"] * row["median_step_s"]
            rows[cell].append(row)
            print(f"  repeat {rep} {cell:10s}: downtime {row['downtime_s']:.3f} s, lost "
                  f"{row['lost_steps']} steps, total {row['total_s']:.3f} s, weights equal "
                  f"{row['weights_equal']}", flush=True)
    cells = {c: {"downtime_s": spread([r["downtime_s"] for r in rows[c]]),
                 "lost_steps": spread([r["lost_steps"] for r in rows[c]]),
                 "total_s": spread([r["total_s"] for r in rows[c]]),
                 "weights_equal": all(r["weights_equal"] for r in rows[c]),
                 "runs": rows[c]} for c in CELLS}
    result = {"commit": git_commit(), "machine": machine_description(), "recipe": recipe,
              "steps": steps, "every": every, "crash_step": crash_step, "repeats": repeats,
              "cells": cells}
    write_result(out_dir, "recovery_sources", result, _table(result))
    return result


def _fmt(s: dict, unit: str = "", digits: int = 3) -> str:
    return (f"{s['median']:.{digits}f}{unit} ({s['min']:.{digits}f} to "
            f"{s['max']:.{digits}f})")


def _table(r: dict) -> str:
    c = r["cells"]
    ratio = c["snapshot"]["downtime_s"]["median"] / c["replica"]["downtime_s"]["median"]
    lo = c["snapshot"]["downtime_s"]["min"] / c["replica"]["downtime_s"]["max"]
    hi = c["snapshot"]["downtime_s"]["max"] / c["replica"]["downtime_s"]["min"]
    lines = [f"# bench sources: a crash recovered from each source ({r['recipe']}, "
             f"{r['steps']} steps, crash at step {r['crash_step']}, snapshots/checkpoints "
             f"every {r['every']} steps; commit {r['commit']})", "",
             f"Median of {r['repeats']} repeats (min to max). Downtime: the fault to the "
             "first committed step after it. Total: downtime plus the lost (replayed) steps "
             "at the run's median step time.", "",
             "| source | layout | downtime (s) | lost steps | total (s) | weights equal |",
             "|---|---|---|---|---|---|"]
    for cell, layout in (("replica", "DP2 x PP2"), ("snapshot", "DP1 x PP2"),
                         ("checkpoint", "DP1 x PP2")):
        x = c[cell]
        lines.append(f"| {cell} | {layout} | {_fmt(x['downtime_s'])} | "
                     f"{_fmt(x['lost_steps'], digits=0)} | {_fmt(x['total_s'])} | "
                     f"{x['weights_equal']} |")
    lines += ["", f"Snapshot downtime / replica downtime: {ratio:.2f} (range {lo:.2f} to "
              f"{hi:.2f}; target at most 2)", ""]
    return "\n".join(lines)
