"""``bench checkpoint``: what periodic checkpoints cost the training step, to choose the
default interval (``checkpoint.every``; the target: at most 1% of step time).

The built-in trainer runs as ``trainmover run`` runs it, with checkpoints off and at each
interval asked, interleaved over the repeats (rotating the order). Two figures per run:

- the job's mean step time (commit to commit, as metrics.jsonl records it, warm-up steps
  left out) against the same figure with checkpoints off, in the same repeat;
- the cost of one checkpoint: the mean step gap that contains a save (the synchronous host
  copy at the boundary, and the background write sharing the cores during the next step)
  minus the run's median gap. Amortised over the interval and divided by the median step
  time, it is the fraction of step time checkpointing costs at that interval: measurable
  even where the whole-job ratio is inside the noise.
"""
from __future__ import annotations

import os
import statistics
import tempfile

from trainmover.bench.report import git_commit, machine_description, write_result
from trainmover.core.events import read_jsonl
from trainmover.core.topology import Layout
from trainmover.recipes import get_recipe

SKIP = 5   # warm-up steps left out


def _run(cfg, every: int, timeout_s: float) -> dict:
    from trainmover.control.coordinator import run_job

    cfg = type(cfg).from_dict(cfg.to_dict())
    cfg.checkpoint.every = every
    with tempfile.TemporaryDirectory(prefix="tm-bench-ckpt-") as scratch:
        run_dir = os.path.join(scratch, "run")
        run_job(cfg.validate(), run_dir, quiet=True, timeout_s=timeout_s)
        records = sorted(read_jsonl(os.path.join(run_dir, "metrics.jsonl")),
                         key=lambda r: r["step"])
        syncs = [e["sync_s"] for e in read_jsonl(os.path.join(run_dir, "events.jsonl"))
                 if e["event"] == "checkpoint_taken" and e["step"] > 0]
    # gap i: from step i-1's commit to step i's; a save after step s-1 (checkpoint "s")
    # lands in gap s
    gaps = {r["step"]: r["time"] - p["time"] for p, r in zip(records, records[1:])}
    timed = {s: g for s, g in gaps.items() if s >= SKIP}
    median = statistics.median(timed.values())
    with_save = [g for s, g in timed.items() if every and s % every == 0]
    return {"every": every, "mean_step_s": statistics.fmean(timed.values()),
            "median_step_s": median, "steps_timed": len(timed),
            "save_gaps": len(with_save),
            "cost_per_checkpoint_s": (statistics.fmean(with_save) - median) if with_save
            else None,
            "sync_copy_s": statistics.median(syncs) if syncs else None}


def bench_checkpoint(intervals: list[int], steps: int = 60, repeats: int = 3,
                     recipe: str = "demo", out_dir: str = "benchmarks/results") -> dict:
    if not intervals or any(n < 1 for n in intervals):
        raise ValueError(f"--intervals must be positive step counts, got {intervals}")
    if steps <= SKIP + 2 * max(intervals):
        raise ValueError(f"--steps {steps} must exceed {SKIP} + twice the largest interval "
                         f"({max(intervals)}), so each run takes at least one timed save")
    cfg = get_recipe(recipe)
    cfg.layout = Layout(2, 2, 1)
    cfg.train.steps = steps
    cfg.standby.count = 0
    names = [0, *intervals]
    rows = []
    for rep in range(repeats):
        k = rep % len(names)
        for every in names[k:] + names[:k]:
            row = {"repeat": rep, **_run(cfg, every, 900)}
            rows.append(row)
            print(f"  repeat {rep} every {every or 'off':>4}: mean {row['mean_step_s'] * 1e3:.1f}"
                  f" ms/step" + ("" if row["cost_per_checkpoint_s"] is None else
                                 f", {row['cost_per_checkpoint_s'] * 1e3:.1f} ms per checkpoint"),
                  flush=True)
    cells = {}
    for every in intervals:
        ratios, fractions = [], []
        for rep in range(repeats):
            by = {r["every"]: r for r in rows if r["repeat"] == rep}
            ratios.append(by[every]["mean_step_s"] / by[0]["mean_step_s"])
            fractions.append(by[every]["cost_per_checkpoint_s"] /
                             (every * by[every]["median_step_s"]))
        cells[every] = {"job_ratio": ratios, "amortised_fraction": fractions}
    result = {"benchmark": "checkpoint", "recipe": recipe, "layout": cfg.layout.as_dict(),
              "steps": steps, "skip": SKIP, "model_params": cfg.model.num_params(),
              "rows": rows, "cells": {str(k): v for k, v in cells.items()},
              "commit": git_commit(), "machine": machine_description()}
    write_result(out_dir, "checkpoint_cost", result, _table(result, intervals))
    return result


def _spread(values: list[float], fmt: str) -> str:
    return (f"{fmt.format(statistics.median(values))} "
            f"({fmt.format(min(values))} to {fmt.format(max(values))})")


def _table(r: dict, intervals: list[int]) -> str:
    rows = r["rows"]
    off = [x["mean_step_s"] for x in rows if x["every"] == 0]
    lines = [f"# bench checkpoint: periodic checkpoints' cost ({r['recipe']}, DP2 x PP2, "
             f"{r['model_params'] / 1e6:.2f}M params, {r['steps']} steps, first {r['skip']} "
             f"left out, commit {r['commit']})", "",
             "Median of the repeats, (min to max). `job ratio`: mean step time with "
             "checkpoints at the interval / with them off, same repeat. `per checkpoint`: "
             "mean step gap containing a save minus the run's median gap. `amortised`: "
             "per checkpoint / (interval x median step): the share of step time spent on "
             "checkpointing.", "",
             f"Checkpoints off: mean step {_spread([x * 1e3 for x in off], '{:.1f}')} ms.", "",
             "| every | job ratio | per checkpoint (ms) | host copy (ms) | amortised |",
             "|---|---|---|---|---|"]
    for every in intervals:
        mine = [x for x in rows if x["every"] == every]
        cell = r["cells"][str(every)]
        ratio = cell["job_ratio"]
        verdict = "no measurable difference" if min(ratio) <= 1.0 <= max(ratio) else ""
        syncs = [x["sync_copy_s"] * 1e3 for x in mine if x["sync_copy_s"] is not None]
        lines.append(
            f"| {every} | {_spread(ratio, '{:.3f}')} {verdict} | "
            f"{_spread([x['cost_per_checkpoint_s'] * 1e3 for x in mine], '{:.1f}')} | "
            f"{_spread(syncs, '{:.2f}') if syncs else '-'} | "
            f"{_spread([f * 100 for f in cell['amortised_fraction']], '{:.2f}')}% |")
    lines += ["", f"Machine: {r['machine']}", ""]
    return "\n".join(lines)
