"""``bench straggler``: one worker slowed by ``factor`` from step ``onset`` on; how soon it is
detected and what the slowness costs the run, for trainmover (detect, migrate onto a warm
standby) against the two remedies a checkpoint-restart job has: restart as soon as the
straggler is detected, or keep training slowly until the next scheduled checkpoint and
restart then (no work lost).

Measured per repeat, on the same job (DP2 x PP2, one standby):
- a clean run (no straggler; the detector on, so both pay for the measurements);
- the trainmover run (``straggler.policy=migrate``): detection step and time (the
  ``straggler_detected`` event), the migration, and its efficiency loss, measured: the time
  from the onset's commit to the last step's, over the clean run's same span, minus one;
- a restart of the same job (``baseline.restart_at_step``): its downtime, stop to the first
  step committed by the fresh processes.

The two restart strategies are then composed from those measurements (they share the
detector, so their detection is trainmover's): with clean step time ``t``, the slow job's
step time ``t_s`` (measured between the onset and the detection), detection after ``d``
steps, checkpoints every ``C`` steps and the restart's downtime ``R``:
- restart immediately: ``d (t_s - t) + R + w t``, where ``w`` steps since the last
  checkpoint are computed again;
- defer: ``(k - onset)(t_s - t) + R``, ``k`` the first checkpoint step after the detection;
each over the clean span. Composed, not run, because the slow worker here is a process,
not a machine: restarted fresh processes would not be slow (or, keyed by name, would be);
docs/benchmarks.md says so beside the figures.
"""
from __future__ import annotations

import os
import statistics
import tempfile

from trainmover.bench.report import (BenchLine, git_commit, machine_description, spread,
                                     write_result)
from trainmover.core.events import read_jsonl
from trainmover.core.faults import Inject, worker_faults
from trainmover.core.topology import Layout
from trainmover.recipes import get_recipe


def _job(recipe: str, steps: int, every: int):
    cfg = get_recipe(recipe)
    cfg.layout = Layout(2, 2, 1)
    cfg.train.steps = steps
    cfg.train.threads_per_worker = 1
    cfg.standby.count = 1
    cfg.checkpoint.every = every
    cfg.straggler.policy = "alert"
    return cfg


def _commits(run_dir: str) -> dict[int, float]:
    """Step -> the time of its (last) commit."""
    out = {}
    for r in sorted(read_jsonl(os.path.join(run_dir, "metrics.jsonl")),
                    key=lambda r: r["time"]):
        out[r["step"]] = r["time"]
    return out


def _run(cfg, timeout_s: float) -> tuple[dict, dict[int, float], list[dict]]:
    from trainmover.control.coordinator import run_job

    with tempfile.TemporaryDirectory(prefix="tm-bench-strag-") as scratch:
        run_dir = os.path.join(scratch, "run")
        summary = run_job(cfg.validate(), run_dir, quiet=True, timeout_s=timeout_s)
        return summary, _commits(run_dir), read_jsonl(os.path.join(run_dir, "events.jsonl"))


def _median_gap(commits: dict[int, float], first: int, last: int) -> float:
    gaps = [commits[s] - commits[s - 1] for s in range(first, last + 1)
            if s in commits and s - 1 in commits]
    return statistics.median(gaps)


def _repeat(recipe, steps, onset, factor, every, timeout_s) -> dict:
    base = _job(recipe, steps, every)
    _, clean, _ = _run(base, timeout_s)
    slow = type(base).from_dict(base.to_dict())
    slow.straggler.policy = "migrate"
    slow.faults = worker_faults([Inject("slow", onset, "w1", str(factor))])
    summary, commits, events = _run(slow, timeout_s)
    detected = [e for e in events if e["event"] == "straggler_detected"]
    if not detected:
        raise RuntimeError(f"the {factor}x straggler was not detected in {steps} steps")
    det = detected[0]
    last = steps - 1
    span_clean = clean[last] - clean[onset - 1]
    t = _median_gap(clean, onset, last)
    t_s = _median_gap(commits, onset + 2, det["step"])
    d = det["step"] - onset + 1
    moved = [m for m in summary["migrations"] if m.get("source") == "straggler"]
    # the restart's downtime on this job (checkpoints every step, so it loses no work: the
    # composed figures add the lost work themselves)
    restart = _job(recipe, onset + 20, 1)
    restart.baseline.restart_at_step = onset
    restart.agent.fork_server = False     # a restart starts new processes
    restart_summary, _, _ = _run(restart, timeout_s)
    r = restart_summary["restarts"][0]["downtime_s"]
    lost = (onset + d) % every        # steps since the newest checkpoint at the detection
    next_ckpt = -(-(onset + d) // every) * every
    return {
        "clean_step_s": t, "slow_step_s": t_s, "detection_steps": d,
        "detection_s": det["time"] - commits[onset - 1], "restart_downtime_s": r,
        "migrated": bool(moved),
        "migration_downtime_s": moved[0]["downtime_s"] if moved else None,
        "loss": {
            "trainmover": (commits[last] - commits[onset - 1]) / span_clean - 1.0,
            "restart_immediately": (d * (t_s - t) + r + lost * t) / span_clean,
            "defer": ((next_ckpt - onset) * (t_s - t) + r) / span_clean,
        },
    }



def bench_straggler(steps: int = 400, onset: int = 60, factor: float = 1.2, repeats: int = 3,
                    every: int = 50, recipe: str = "demo", out_dir: str = "benchmarks/results",
                    json_path: str | None = None, timeout_s: float = 1200.0) -> dict:
    if repeats < 3:
        raise ValueError(f"--repeats {repeats}: at least 3 (a median with its spread)")
    if not factor > 1.0:
        raise ValueError(f"--factor {factor}: a slowdown is a factor over 1")
    if not 10 <= onset < steps - 100:
        raise ValueError(f"--onset {onset}: between 10 and steps - 100 ({steps - 100})")
    if every < 1:
        raise ValueError(f"--every {every}: a checkpoint interval of at least 1 step")
    runs = []
    line = BenchLine("bench straggler", repeats)
    for k in range(repeats):
        line.start(f"repeat {k + 1}: clean, slow and restart runs")
        runs.append(_repeat(recipe, steps, onset, factor, every, timeout_s))
        x = runs[-1]
        line.finish(f"repeat {k + 1}/{repeats}: detected after {x['detection_steps']} steps "
                    f"({x['detection_s']:.2f} s); loss trainmover {x['loss']['trainmover']:.2%}, "
                    f"restart now {x['loss']['restart_immediately']:.2%}, "
                    f"defer {x['loss']['defer']:.2%}")
    line.close()
    strategies = ("trainmover", "restart_immediately", "defer")
    det_steps = spread([x["detection_steps"] for x in runs])
    det_s = spread([x["detection_s"] for x in runs])
    results = [{"strategy": s, "efficiency_loss": statistics.median(x["loss"][s] for x in runs),
                "efficiency_loss_min": min(x["loss"][s] for x in runs),
                "efficiency_loss_max": max(x["loss"][s] for x in runs),
                "detection_steps": det_steps["median"], "detection_s": det_s["median"],
                "measured": s == "trainmover"} for s in strategies]
    result = {"commit": git_commit(), "machine": machine_description(), "recipe": recipe,
              "layout": "DP2 x PP2 x TP1", "steps": steps, "onset": onset, "factor": factor,
              "checkpoint_every": every, "repeats": repeats, "results": results, "runs": runs,
              "detection_steps": det_steps, "detection_s": det_s}
    table = _table(result)
    write_result(out_dir, "straggler", result, table, json_path)
    return result


def _table(r: dict) -> str:
    def pct(x):
        return f"{x * 100:.2f}%"

    runs = r["runs"]
    lines = [
        "# A straggler: detection and what it costs", "",
        f"Commit {r['commit']}; {r['layout']}, recipe `{r['recipe']}`, {r['steps']} steps, "
        f"worker w1 slowed {r['factor']}x from step {r['onset']}; checkpoints every "
        f"{r['checkpoint_every']} steps; {r['repeats']} repeats (median, min-max). Efficiency "
        f"loss: extra time from the onset to the end over the clean run's.", "",
        f"Detection: {r['detection_steps']['median']:.0f} steps "
        f"({r['detection_steps']['min']:.0f}-{r['detection_steps']['max']:.0f}) after the "
        f"onset, {r['detection_s']['median']:.2f} s "
        f"({r['detection_s']['min']:.2f}-{r['detection_s']['max']:.2f}).", "",
        "| strategy | efficiency loss | how obtained |", "|---|---|---|",
    ]
    how = {"trainmover": "measured: detected, migrated to a warm standby",
           "restart_immediately": "composed from measured parts: restart at detection",
           "defer": "composed from measured parts: slow until the next checkpoint, restart"}
    for x in r["results"]:
        lines.append(f"| {x['strategy']} | {pct(x['efficiency_loss'])} "
                     f"({pct(x['efficiency_loss_min'])} to {pct(x['efficiency_loss_max'])}) "
                     f"| {how[x['strategy']]} |")
    lines += ["", "Measured parts (median): clean step "
              f"{statistics.median(x['clean_step_s'] for x in runs) * 1000:.1f} ms, slow step "
              f"{statistics.median(x['slow_step_s'] for x in runs) * 1000:.1f} ms, restart "
              f"downtime {statistics.median(x['restart_downtime_s'] for x in runs):.2f} s, "
              f"straggler migration downtime "
              + ", ".join("-" if x["migration_downtime_s"] is None
                          else f"{x['migration_downtime_s'] * 1000:.0f} ms" for x in runs)
              + "."]
    return "\n".join(lines) + "\n"
