"""``trainmover bench example-downtime``: a planned migration's and a crash's downtime for a
user's FSDP2 + tensor-parallel script (``examples/torch_fsdp_tp.py``, torch's own
``fully_shard`` and ``parallelize_module`` on trainmover's process groups) against the
built-in trainer's on the same layout (dp 2 x tp 2) and the same model (the demo recipe's
GPT: 4 blocks of width 128, 16 sequences of 64 tokens a step: the example's defaults).

Each cell runs ``--repeats`` times, the two trainers interleaved. The figures are the
runtime's own, from each run's summary:
- a planned migration (``migrate@EVENT:w1``, one warm standby): its ``downtime_s``, the
  slowest stayer's extra time over its normal steps (``core/accounting.py``);
- a crash (``crash@EVENT:w1``, SIGKILL inside the step): its ``downtime_s``, from the
  fault to the first step committed after it, and its ``lost_steps``. They are not the same
  recovery: the built-in trainer's data-parallel roles are replicas, so the failed role's
  state comes from one and nothing is redone; FSDP2's roles hold shards, so every role goes
  back to the newest checkpoint (``--checkpoint-every``) and redoes the steps after it,
  which costs ``lost_steps`` normal steps more.
Median (min-max) per cell; the ratio is script / built-in of the medians.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

from trainmover.bench.report import (fmt_spread, git_commit, machine_description, spread,
                                     write_result)

LAYOUT = ("--dp", "2", "--tp", "2")
VICTIM = "w1"                 # dp0.tp1: a middle role
TARGET_RATIO = 1.5            # the target: within 1.5x of the built-in trainer's


def _command(trainer: str, run_dir: str, steps: int, inject: str, every: int) -> list[str]:
    # one intra-op thread per process on both sides (the built-in trainer's default with
    # more processes than cores; the launcher's is set)
    common = [*LAYOUT, "--run-dir", run_dir, "--quiet", "--standbys", "1", "--inject", inject]
    if trainer == "builtin":
        return [sys.executable, "-m", "trainmover", "run", "--recipe", "demo", "--steps",
                str(steps), *common]
    script = os.path.join(os.getcwd(), "examples", "torch_fsdp_tp.py")
    if not os.path.exists(script):
        raise ValueError(f"bench example-downtime runs from the repository root (no "
                         f"{script})")
    return [sys.executable, "-m", "trainmover", "launch", *common, "--threads", "1",
            "--dp-sharded", "--checkpoint-every", str(every), "--", sys.executable, script,
            "--steps", str(steps)]


def _one(trainer: str, scenario: str, steps: int, event: int, every: int, scratch: str,
         timeout_s: float) -> dict:
    run_dir = os.path.join(scratch, f"{trainer}-{scenario}-{os.urandom(4).hex()}")
    kind = "migrate" if scenario == "planned" else "crash"
    res = subprocess.run(_command(trainer, run_dir, steps, f"{kind}@{event}:{VICTIM}", every),
                         capture_output=True, text=True, timeout=timeout_s)
    if res.returncode != 0:
        raise RuntimeError(f"{trainer} {scenario}: exit {res.returncode}: {res.stderr[-2000:]}")
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    shutil.rmtree(run_dir, ignore_errors=True)
    if scenario == "planned":
        (m,) = summary["migrations"]
        if m["status"] != "done":
            raise RuntimeError(f"{trainer}: the migration ended {m['status']}: {m}")
        return {"downtime_s": m["downtime_s"], "lost_steps": 0,
                "step_s": summary["mean_step_time_s"]}
    (r,) = summary["recoveries"]
    return {"downtime_s": r["downtime_s"], "lost_steps": r["lost_steps"],
            "step_s": summary["mean_step_time_s"]}


def bench_example_downtime(repeats: int = 3, steps: int = 40, event: int = 20,
                           checkpoint_every: int = 5, out_dir: str = "benchmarks/results",
                           timeout_s: float = 900) -> dict:
    if repeats < 1 or not 0 < event < steps - 5:
        raise ValueError(f"--repeats must be >= 1 and --event-step inside the job's steps "
                         f"(with 5 to spare), got repeats={repeats} event={event} "
                         f"steps={steps}")
    scratch = tempfile.mkdtemp(prefix="tm-bench-example-downtime-")
    runs: dict[tuple[str, str], list[dict]] = {}
    try:
        for r in range(repeats):
            order = ("script", "builtin") if r % 2 == 0 else ("builtin", "script")
            for scenario in ("planned", "crash"):
                for trainer in order:
                    one = _one(trainer, scenario, steps, event, checkpoint_every, scratch,
                               timeout_s)
                    runs.setdefault((scenario, trainer), []).append(one)
                    print(f"  {scenario:8s} {trainer:8s} run {r + 1}: downtime "
                          f"{one['downtime_s']:.3f} s, lost steps {one['lost_steps']}",
                          flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    cells = []
    for scenario in ("planned", "crash"):
        row = {"scenario": scenario}
        for trainer in ("script", "builtin"):
            done = runs[(scenario, trainer)]
            row[trainer] = {"downtime_s": spread([d["downtime_s"] for d in done]),
                            "lost_steps": spread([d["lost_steps"] for d in done]),
                            "step_s": spread([d["step_s"] for d in done]), "runs": done}
        row["ratio"] = row["script"]["downtime_s"]["median"] / \
            row["builtin"]["downtime_s"]["median"]
        base = row["builtin"]["downtime_s"]
        # none where the built-in's downtime is inside the noise (at or below zero)
        row["within_target"] = None if base["min"] <= 0 else row["ratio"] <= TARGET_RATIO
        cells.append(row)
    result = {"benchmark": "example_downtime", "script": "examples/torch_fsdp_tp.py",
              "layout": list(LAYOUT), "victim": VICTIM, "repeats": repeats, "steps": steps,
              "event_step": event, "checkpoint_every": checkpoint_every,
              "target_ratio": TARGET_RATIO, "cells": cells, "machine": machine_description(),
              "commit": git_commit()}
    write_result(out_dir, "example_downtime_torch_fsdp_tp", result, _table(result))
    return result


def _table(r: dict) -> str:
    lines = ["# bench example-downtime: examples/torch_fsdp_tp.py (FSDP2 + TP, --dp-sharded) "
             "vs the built-in trainer, dp 2 x tp 2, the same GPT",
             "",
             f"Machine: {r['machine']['cpu']}, {r['machine']['cores']} cores, torch "
             f"{r['machine']['torch']}; commit {r['commit']}; {r['repeats']} interleaved "
             f"repeats of {r['steps']} steps, the event at step {r['event_step']} on "
             f"{r['victim']} (dp0.tp1); the script checkpoints every "
             f"{r['checkpoint_every']} steps. Median (min-max).",
             "",
             "| event | script downtime (s) | built-in downtime (s) | ratio | script lost steps "
             "| built-in lost steps | script step (s) | built-in step (s) |",
             "|---|---|---|---|---|---|---|---|"]
    for c in r["cells"]:
        s, b = c["script"], c["builtin"]
        lines.append(f"| {c['scenario']} | {fmt_spread(s['downtime_s'])} | "
                     f"{fmt_spread(b['downtime_s'])} | {_ratio(c)} | "
                     f"{fmt_spread(s['lost_steps'], 0)} | {fmt_spread(b['lost_steps'], 0)} | "
                     f"{fmt_spread(s['step_s'])} | {fmt_spread(b['step_s'])} |")
    lines += ["", f"Target: within {r['target_ratio']}x of the built-in trainer's. A crash "
              "is not the same recovery on both sides: the built-in trainer's dp roles are "
              "replicas (the failed role's state comes from one, nothing is redone); FSDP2's "
              "hold shards (every role goes back to the newest checkpoint and redoes the "
              "steps after it): its downtime ends at the first step committed after the "
              "rollback, and the lost steps are redone after that at a normal step's cost.",
              "", "A downtime at or below zero is inside the noise of the step times it is "
              "measured against (the slowest stayer's extra time over its normal steps); a "
              "ratio to it is not a ratio.", ""]
    return "\n".join(lines)


def _ratio(cell: dict) -> str:
    """The script / built-in ratio of the medians, or why there is none."""
    base = cell["builtin"]["downtime_s"]
    if base["min"] <= 0:
        return "none: the built-in's is inside the noise"
    return f"{cell['ratio']:.2f}"
