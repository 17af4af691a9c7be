"""``bench ettr``: effective training time ratio under rolling maintenance. A job runs for
``minutes`` with a worker moved onto a warm standby every ``every`` seconds
(``maintenance.rebalance_every_s``), and again without events. ETTR = useful step time /
wall time, relative to the same for the run without events; the useful time is the run's
steps at its own normal pace (median commit gap), so the pace of the shared machine, which
drifts between two runs, cancels out. Beside it: the plain ratio of the two runs' times for
the same steps, and both runs' normal steps (a slowdown of every step would show there).

Per repeat: a calibration of the step time sizes the runs (both run the same steps); the
trainmover run and the clean run are measured commit to commit (metrics.jsonl, warm-up
steps left out); a restart of the same job (``baseline.restart_at_step``, checkpoints every
step so it loses no work) gives the restart's downtime ``R``. The restart strategy's ETTR is
composed from it: the clean time over the clean time plus one ``R`` per event of the
trainmover run (a restart per maintenance event, at a checkpoint boundary: the most
favourable case for restart).
"""
from __future__ import annotations

import os
import statistics
import tempfile

from trainmover.bench.report import BenchLine, git_commit, machine_description, write_result
from trainmover.core.events import read_jsonl
from trainmover.core.topology import Layout
from trainmover.recipes import get_recipe

SKIP = 5


def _job(recipe: str, steps: int, standbys: int = 1, replenish: bool = True):
    cfg = get_recipe(recipe)
    cfg.layout = Layout(2, 2, 1)
    cfg.train.steps = steps
    cfg.train.threads_per_worker = 1
    cfg.standby.count = standbys
    cfg.standby.replenish = replenish
    cfg.standby.replenish_max = 1000 if replenish else 0
    return cfg


def _run(cfg, timeout_s: float) -> tuple[dict, list[dict]]:
    from trainmover.control.coordinator import run_job

    with tempfile.TemporaryDirectory(prefix="tm-bench-ettr-") as scratch:
        run_dir = os.path.join(scratch, "run")
        summary = run_job(cfg.validate(), run_dir, quiet=True, timeout_s=timeout_s)
        records = sorted(read_jsonl(os.path.join(run_dir, "metrics.jsonl")),
                         key=lambda r: r["time"])
    return summary, records


def _span(records: list[dict]) -> float:
    """From the commit of step SKIP - 1 to the last commit."""
    start = next(r["time"] for r in records if r["step"] == SKIP - 1)
    return records[-1]["time"] - start


def _efficiency(records: list[dict]) -> tuple[float, float]:
    """(useful step time / wall time, normal step) over the same span as ``_span``: the
    useful time is the span's steps at the run's own normal pace (the median commit gap).
    Run against run, this ratio is immune to the machine's speed drifting between two runs
    (a shared machine's pace moves by several percent from one run to the next); what it
    cannot see is a slowdown of every step of one run, which the normal steps printed beside
    it show."""
    times = [r["time"] for r in records if r["step"] >= SKIP - 1]
    gaps = [b - a for a, b in zip(times, times[1:])]
    normal = statistics.median(gaps)
    return normal * len(gaps) / (times[-1] - times[0]), normal


def _repeat(recipe: str, minutes: float, every: float, standbys: int, replenish: bool,
            timeout_s: float) -> dict:
    _, calib = _run(_job(recipe, 60, standbys, replenish), timeout_s)
    step_s = statistics.median(b["time"] - a["time"] for a, b in zip(calib, calib[1:])
                               if b["step"] >= SKIP)
    steps = max(SKIP + 20, int(minutes * 60 / step_s))
    clean_summary, clean = _run(_job(recipe, steps, standbys, replenish), timeout_s)
    moving = _job(recipe, steps, standbys, replenish)
    moving.maintenance.rebalance_every_s = every
    summary, records = _run(moving, timeout_s)
    if summary["weights_sha256"] != clean_summary["weights_sha256"]:
        raise RuntimeError("the run with migrations ended with other weights than the clean "
                           "run: see the job's events")
    events = [m for m in summary["migrations"] if m.get("source") == "rebalance"]
    restart = _job(recipe, 40)
    restart.checkpoint.every = 1
    restart.baseline.restart_at_step = 20
    restart.agent.fork_server = False     # a restart starts new processes
    r = _run(restart, timeout_s)[0]["restarts"][0]["downtime_s"]
    clean_s, moving_s = _span(clean), _span(records)
    (clean_eff, clean_step), (moving_eff, moving_step) = _efficiency(clean), _efficiency(records)
    done = [m for m in events if m["status"] == "done"]
    # where the time went: the switches' stalls and what their background preparation cost
    # the steps (both measured on every stayer); the rest is outside the migrations
    stall = sum(m["downtime_s"] or 0.0 for m in done)
    phase1 = sum(m["phases"].get("phase1_slowdown_s") or 0.0 for m in done)
    return {"steps": steps, "clean_s": clean_s, "trainmover_s": moving_s,
            "events": len(events), "done": len(done),
            "lost_s": moving_s - clean_s, "stall_s": stall, "phase1_s": phase1,
            "migration_downtime_s": [m.get("downtime_s") for m in events],
            "restart_downtime_s": r,
            "clean_step_s": clean_step, "trainmover_step_s": moving_step,
            "ettr": {"trainmover": moving_eff / clean_eff,
                     "restart": clean_s / (clean_s + len(events) * r)},
            "ettr_same_steps": clean_s / moving_s}


def bench_ettr(minutes: float = 10.0, every: float = 60.0, repeats: int = 3,
               recipe: str = "demo", out_dir: str = "benchmarks/results",
               json_path: str | None = None, timeout_s: float | None = None,
               standbys: int = 1, replenish: bool = True, name: str = "ettr") -> dict:
    if repeats < 3:
        raise ValueError(f"--repeats {repeats}: at least 3 (a median with its spread)")
    if standbys < 1:
        raise ValueError(f"--standbys {standbys}: a migration needs a standby")
    if not minutes > 0 or not 0 < every < minutes * 60:
        raise ValueError(f"--every {every} s must be within the run's --minutes {minutes}")
    moves = int(minutes * 60 // every)
    if not replenish and standbys < moves:
        raise ValueError(f"--standbys {standbys} with --no-replenish: a run of {minutes} min "
                         f"moves a worker about {moves} times, each onto a standby of its own")
    timeout_s = timeout_s or minutes * 60 * 3 + 600
    runs = []
    line = BenchLine("bench ettr", repeats)
    for k in range(repeats):
        line.start(f"repeat {k + 1}: calibration, clean run, run with moves, a restart")
        runs.append(_repeat(recipe, minutes, every, standbys, replenish, timeout_s))
        x = runs[-1]
        line.finish(f"repeat {k + 1}/{repeats}: {x['events']} events, ETTR trainmover "
                    f"{x['ettr']['trainmover']:.4f}, restart {x['ettr']['restart']:.4f}")
    line.close()
    results = []
    for s in ("trainmover", "restart"):
        xs = [x["ettr"][s] for x in runs]
        results.append({"scenario": "rebalance", "strategy": s, "ettr": statistics.median(xs),
                        "ettr_min": min(xs), "ettr_max": max(xs),
                        "events": statistics.median(x["events"] for x in runs),
                        "measured": s == "trainmover"})
    result = {"commit": git_commit(), "machine": machine_description(), "recipe": recipe,
              "layout": "DP2 x PP2 x TP1", "minutes": minutes, "every_s": every,
              "standbys": standbys, "replenish": replenish,
              "repeats": repeats, "results": results, "runs": runs}
    table = _table(result)
    write_result(out_dir, name, result, table, json_path)
    return result


def _table(r: dict) -> str:
    lines = [
        "# ETTR under rolling maintenance", "",
        f"Commit {r['commit']}; {r['layout']}, recipe `{r['recipe']}`, runs of "
        f"{r['minutes']} min with a worker moved to a warm standby every {r['every_s']:.0f} s "
        f"({r['standbys']} standby(s), "
        + ("replenished: each new standby starts, imports and warms up on the job's cores"
           if r["replenish"] else "started before the run, not replenished")
        + f"); {r['repeats']} repeats (median, min-max). ETTR: useful step time (the run's "
        f"steps at its own normal pace) over wall time, relative to the same for the run "
        f"without events (which has the same standbys); this cancels the machine's pace "
        f"drifting between runs. Same-steps ratio: the clean run's time for the same steps "
        f"over the run's own, drift included.", "",
        "| strategy | ETTR | events | how obtained |", "|---|---|---|---|"]
    how = {"trainmover": "measured (weights equal to the clean run's)",
           "restart": "composed: clean time + one measured restart downtime per event"}
    for x in r["results"]:
        lines.append(f"| {x['strategy']} | {x['ettr']:.4f} ({x['ettr_min']:.4f}-"
                     f"{x['ettr_max']:.4f}) | {x['events']:.0f} | {how[x['strategy']]} |")
    lines += ["", "Per repeat: " + "; ".join(
        f"{x['steps']} steps, clean {x['clean_s']:.1f} s, with events {x['trainmover_s']:.1f} "
        f"s (same-steps ratio {x['clean_s'] / x['trainmover_s']:.4f}), normal step "
        f"{x['clean_step_s'] * 1e3:.1f} / {x['trainmover_step_s'] * 1e3:.1f} ms, restart "
        f"downtime {x['restart_downtime_s']:.2f} s" for x in r["runs"] if "clean_step_s" in x)
        + "."]
    lines += ["", "Where the lost time went, per repeat (seconds: lost = with events - clean; "
              "the switches' stalls and their background preparation's cost to the steps are "
              "measured on every stayer; the rest is outside the migrations, e.g. new standbys "
              "starting on the same cores, or run-to-run noise): " + "; ".join(
                  f"lost {x['lost_s']:.1f}, stalls {x['stall_s']:.2f}, preparation "
                  f"{x['phase1_s']:.2f}, rest {x['lost_s'] - x['stall_s'] - x['phase1_s']:.1f}"
                  for x in r["runs"] if "lost_s" in x) + "."]
    return "\n".join(lines) + "\n"
