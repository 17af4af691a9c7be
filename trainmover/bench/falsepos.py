"""``bench false-positives``: the straggler detector on jobs with no sick worker, to count
the workers it flags anyway (target: none). Three cases, in turn: a plain job; every worker
slowed together from a step on (longer sequences for everyone); the last pipeline stage
heavier by design from the start (its two workers slowed 1.5x). DP2 x PP2, the detector's
defaults, ``straggler.policy=alert``."""
from __future__ import annotations

import os
import tempfile

from trainmover.bench.report import git_commit, machine_description, write_result
from trainmover.core.faults import Inject, worker_faults
from trainmover.core.topology import Layout
from trainmover.recipes import get_recipe

CASES = {
    "plain": [],
    "everyone_slowed": [Inject("slow", 40, w, "1.5") for w in ("w0", "w1", "w2", "w3")],
    "last_stage_heavier": [Inject("slow", 1, w, "1.5") for w in ("w1", "w3")],
}


def bench_false_positives(runs: int = 21, steps: int = 200, recipe: str = "tiny",
                          out_dir: str = "benchmarks/results",
                          timeout_s: float = 600.0) -> dict:
    from trainmover.control.coordinator import run_job

    if runs < 3:
        raise ValueError(f"--runs {runs}: at least 3 (one per case)")
    names = list(CASES)
    rows = []
    for k in range(runs):
        case = names[k % len(names)]
        cfg = get_recipe(recipe)
        cfg.layout = Layout(2, 2, 1)
        cfg.train.steps = steps
        cfg.train.seed = 1 + k
        cfg.train.threads_per_worker = 1
        cfg.standby.count = 0
        cfg.straggler.policy = "alert"
        cfg.faults = worker_faults(CASES[case])
        with tempfile.TemporaryDirectory(prefix="tm-bench-fp-") as scratch:
            summary = run_job(cfg.validate(), os.path.join(scratch, "run"), quiet=True,
                              timeout_s=timeout_s)
        flagged = [s["worker"] for s in summary.get("stragglers", [])]
        rows.append({"run": k + 1, "case": case, "seed": 1 + k, "flagged": flagged})
        print(f"run {k + 1}/{runs} ({case}): flagged {flagged or 'none'}", flush=True)
    result = {"commit": git_commit(), "machine": machine_description(), "recipe": recipe,
              "steps": steps, "runs": rows,
              "false_positives": sum(len(r["flagged"]) for r in rows),
              "runs_with_a_false_positive": sum(1 for r in rows if r["flagged"])}
    lines = ["# Straggler detector: false positives on healthy jobs", "",
             f"Commit {result['commit']}; DP2 x PP2, recipe `{recipe}`, {steps} steps per run, "
             f"detector defaults, policy alert; {runs} runs over three cases (plain; every "
             f"worker slowed 1.5x from step 40; the last stage's workers 1.5x from step 1).",
             "", f"Workers flagged: **{result['false_positives']}** "
                 f"({result['runs_with_a_false_positive']} of {runs} runs).", "",
             "| run | case | seed | flagged |", "|---|---|---|---|"]
    lines += [f"| {r['run']} | {r['case']} | {r['seed']} | {', '.join(r['flagged']) or '-'} |"
              for r in rows]
    table = "\n".join(lines) + "\n"
    write_result(out_dir, "straggler_false_positives", result, table)
    return result
