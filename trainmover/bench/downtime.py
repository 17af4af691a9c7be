"""``trainmover bench downtime``: a planned migration (trainmover, a cold standby, the naive
migration, a restart) and unexpected failures (a crash, a hang: trainmover vs restart), each
cell run ``--repeats`` times with the strategies interleaved, reported as median (min-max).

What is measured (the README's words, kept true here):

- A planned migration's downtime is the slowest stayer's: from its own step-end times, the
  steps from the switch through two more, minus as many normal steps measured before phase 1
  began (``core/accounting.py``); its noise is the spread of those normal steps, and a
  downtime inside it is reported as no measurable stall, not as a ratio.
- A failure's downtime runs from the fault (delivered from outside: SIGKILL or SIGSTOP) to
  the first step committed after it; a restart's from the stop (planned) or the fault.
- Downtime is also given in normal steps, and its growth with the job's size both ways.
- The physical limit of a planned migration: its transferred bytes over the point-to-point
  bandwidth measured on this machine (one buffer of that size over a gloo pair, round trip),
  plus no extra step; downtime / limit says how far from it we are.
- The joiner's first step against a normal step: the same quantity (a step's own time in
  the loop) on both sides.
"""
from __future__ import annotations

import os
import signal
import statistics
import tempfile
import time

from trainmover.bench.children import run_pair
from trainmover.bench.report import (BenchLine, fmt_spread, git_commit, machine_description,
                                     spread, write_result)
from trainmover.core.accounting import downtime_phrase, downtime_value, within_noise
from trainmover.core.config import JobConfig
from trainmover.core.events import read_jsonl
from trainmover.core.topology import Layout
from trainmover.recipes import get_recipe

LAYOUTS_BY_WORKERS = {4: Layout(2, 2, 1), 8: Layout(2, 2, 2), 16: Layout(2, 4, 2)}
STRATEGIES = ("trainmover", "trainmover_cold", "naive", "restart")
SCENARIOS = ("planned", "crash", "hang")
FAILURE_STRATEGIES = ("trainmover", "restart")
CACHES = {
    "trainmover": "joiner: a standby on a new machine whose own caches (in memory and on disk) "
                  "were filled by its sandboxed warm-up; stayers: their own",
    "trainmover_cold": "joiner: none (a standby on a new machine that skipped warm-up); "
                       "stayers: their own",
    "naive": "joiner: none (started cold on a new machine); stayers: their own",
    "restart": "every restarted process: its own caches from the first start (same machines)",
}
# The baselines whose processes start on new machines or anew: each imports torch itself, as
# a restarted job's do, not forked from the agent's fork server (agent.fork_server), which
# would give them the imports of the first start for free.
ANEW = ("trainmover_cold", "naive", "restart")


def wait_for(cond, job, what: str, timeout_s: float = 1800) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if not job.running():
            raise RuntimeError(f"the job ended while waiting for {what}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _reach_event(job, event_step: int, warm_standby: bool) -> None:
    """Wait until the job reached ``event_step`` (and, if asked, every standby is warm)."""
    from trainmover.core import decisions as C

    coord = job.coordinator
    if warm_standby:
        warming = []

        def warm() -> bool:
            states = list(coord.membership.standbys.values())
            warming.extend(st for st in states if st is C.StandbyState.WARMING)
            # back to cold after warming: its warm-up was skipped (a recording made by other
            # sources: the package was edited during the run), and it stays cold; fail this
            # run now rather than wait out the timeout
            if warming and any(st is C.StandbyState.COLD for st in states):
                raise RuntimeError("the standby's warm-up was skipped and it stays cold (see "
                                   "warmup_skipped in the run's events.jsonl)")
            return all(st is C.StandbyState.WARM for st in states)
        wait_for(warm, job, "a warm standby")
    wait_for(lambda: coord.progress.last_step >= event_step - 1, job, f"step {event_step}")


def normal_gap_before(run_dir: str, t: float, steps: int = 5) -> float | None:
    """The median commit gap of the last ``steps`` steps committed before time ``t``."""
    times = sorted(r["time"] for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
                   if r["time"] < t)[-(steps + 1):]
    gaps = [b - a for a, b in zip(times, times[1:])]
    return statistics.median(gaps) if gaps else None


def _failure_run(strategy: str, scenario: str, cfg: JobConfig, event_step: int, victim: str,
                 run_dir: str, steps_after: int = 6, steps: int | None = None) -> dict:
    """One job under one strategy with one unexpected failure of ``victim``, delivered from
    outside the process (SIGKILL for a crash, SIGSTOP for a hang) once the job reached
    ``event_step`` (for trainmover, also once its standby is warm); ``steps``: as below."""
    from trainmover.api import Job

    cfg = JobConfig.from_dict(cfg.to_dict())
    cfg.train.steps = steps or 100_000
    if strategy == "trainmover":
        cfg.standby.count = 1
    elif strategy == "restart":
        cfg.checkpoint.every = 1
        cfg.baseline.restart_on_failure = True
        cfg.agent.fork_server = False      # a restart starts new processes (see ANEW)
    else:
        raise ValueError(f"strategy {strategy!r} has no {scenario} scenario")
    job = Job(cfg, run_dir, timeout_s=3600).start()
    coord, measured = job.coordinator, False
    try:
        _reach_event(job, event_step, warm_standby=strategy == "trainmover")
        pid = coord.procs.pid(victim)
        t_fault = time.time()
        coord.events.emit("fault_injected", worker=victim, kind=scenario, point="external")
        os.kill(pid, signal.SIGKILL if scenario == "crash" else signal.SIGSTOP)
        if strategy == "trainmover":
            wait_for(lambda: coord.recovery.done, job, "the recovery")
            resume = coord.recovery.done[0]["resume_step"]
        else:
            wait_for(lambda: coord.restarts, job, "the restart")
            resume = coord.restarts[0]["step"]
        wait_for(lambda: steps or coord.progress.last_step >= resume + steps_after, job, "after")
        measured = True
    finally:
        if steps is None or not measured:
            coord.stop()
    summary = job.wait(600 if steps is None else 3600)
    if strategy == "trainmover":
        (event,) = summary["recoveries"]
        detection = max(event["detection_latency_s"].values())
    else:
        (event,) = summary["restarts"]
        detection = None
    return {"downtime_s": event["downtime_s"], "phases": event["phases"],
            "normal_step_s": normal_gap_before(run_dir, t_fault), "downtime_noise_s": None,
            "detection_latency_s": detection, "state_source": event.get("sources"),
            "groups_rebuilt": event.get("groups_rebuilt"), "groups_total": event.get("groups_total"),
            "first_step_ratio": None, "stayer_peak_rss_growth": None, "recording": None,
            "standby_warmup_s": None, "transfer_bytes": None,
            "weights_sha256": summary.get("weights_sha256")}


def _downtime_run(strategy: str, cfg: JobConfig, event_step: int, leaver: str,
                  run_dir: str, steps_after: int = 6, steps: int | None = None) -> dict:
    """One job under one strategy with one planned event at ``event_step`` (for the
    trainmover strategy: at that step or once the standby is warm, whichever is later, since
    a warm standby is the point). The job runs until the event is accounted for, then stops;
    with ``steps``, it trains exactly that many and ends on its own (final weights_sha256)."""
    from trainmover.api import Job

    cfg = JobConfig.from_dict(cfg.to_dict())
    cfg.train.steps = steps or 100_000  # else stopped once the event is measured
    if strategy in ("trainmover", "trainmover_cold"):
        cfg.standby.count = 1
        cfg.standby.warmup = cfg.standby.record = strategy == "trainmover"
    if strategy == "restart":
        cfg.checkpoint.every = 1
        cfg.baseline.restart_at_step = event_step
    if strategy in ANEW:
        cfg.agent.fork_server = False
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}")
    job = Job(cfg, run_dir, timeout_s=3600).start()
    coord, measured = job.coordinator, False
    try:
        _reach_event(job, event_step, warm_standby=strategy == "trainmover")
        if strategy == "restart":
            wait_for(lambda: coord.restarts and (steps or coord.progress.last_step >=
                                                 event_step + steps_after), job, "the restart")
        else:
            result = coord.request_migration([leaver], naive=strategy == "naive",
                                             source="bench").result(timeout=1800)
            if result["status"] != "done":
                raise RuntimeError(f"{strategy}: migration {result['status']}: {result}")
            wait_for(lambda: steps or coord.progress.last_step >= result["switch_step"] +
                     steps_after, job, "steps after the switch")   # (steps: to its end)
        measured = True
    finally:
        if steps is None or not measured:
            coord.stop()
    summary = job.wait(600 if steps is None else 3600)
    if strategy == "restart":
        (event,) = summary["restarts"]
    else:
        (event,) = [m for m in summary["migrations"] if m["status"] == "done"]
    phases = event["phases"]
    normal_train = phases.get("normal_train_step_s")
    events = read_jsonl(os.path.join(run_dir, "events.jsonl"))
    recorded = [e for e in events if e["event"] == "recorded"]
    warmed = [e for e in events if e["event"] == "warmed"]
    return {"downtime_s": event["downtime_s"], "phases": phases, "normal_step_s":
            phases["normal_step_s"], "downtime_noise_s": event.get("downtime_noise_s"),
            "downtime_reporter_s": event.get("downtime_reporter_s"),
            "event_step": event.get("switch_step", event.get("step")),
            "recording": {"files": len(recorded), "bytes": sum(e["bytes"] for e in recorded),
                          "save_s": max([e["save_s"] for e in recorded] or [0.0])}
            if recorded else None,
            "standby_warmup_s": sum(e["duration_s"] for e in warmed) if warmed else None,
            # a step's own time (start to end in the loop) on both sides
            "first_step_ratio": phases["first_step_s"] / normal_train if normal_train else None,
            "transfer_bytes": event.get("transfer_bytes"),
            "groups_rebuilt": event.get("groups_rebuilt"), "groups_total": event.get("groups_total"),
            "stayer_peak_rss_growth": event.get("stayer_peak_rss_growth"),
            "weights_sha256": summary.get("weights_sha256")}


# --- the point-to-point bandwidth of this machine -----------------------------------------------

def _p2p_child(rank: int, address, nbytes: int, repeats: int, out) -> None:
    import torch

    from trainmover.comm.groups import GroupBuilder, StoreClients
    from trainmover.core.topology import GroupSpec, Role

    torch.set_num_threads(1)
    builder = GroupBuilder(StoreClients(address), torch.device("cpu"), 120.0)
    group = builder.build_ranked(GroupSpec("bandwidth", "xfer", (Role(0, 0, 0),) * 2), rank, 0)
    big, ack = torch.zeros(nbytes, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8)
    times = []
    for _ in range(repeats + 1):   # the first round trip connects: not counted
        t0 = time.perf_counter()
        if rank == 0:
            group.send(big, 1).wait()
            group.recv(ack, 1).wait()
        else:
            group.recv(big, 0).wait()
            group.send(ack, 0).wait()
        times.append(time.perf_counter() - t0)
    out.put((rank, times[1:]))
    out.close()
    out.join_thread()
    os._exit(0)   # no group teardown (a destructor can wait on its peer's socket)


def p2p_seconds(nbytes: int, repeats: int = 5, timeout_s: float = 120.0) -> float:
    """The median time to move ``nbytes`` from one process to another over gloo on this
    machine, as one buffer (send, then a one-byte acknowledgement back)."""
    got = run_pair(_p2p_child, (nbytes, repeats), "bandwidth measurement", timeout_s)
    return statistics.median(got[0])


# --- the benchmark --------------------------------------------------------------------------------

def bench_downtime(workers: list[int], compile: bool = True, event_step: int = 8,
                   out_dir: str = "benchmarks/results",
                   json_path: str | None = None, strategies=STRATEGIES,
                   scratch: str | None = None, scenarios=SCENARIOS,
                   name: str = "downtime", repeats: int = 3,
                   compile_up_to: int | None = 8, cells: list | None = None,
                   table=None, command: str | None = None) -> dict:
    """Every (workers, scenario, strategy) cell ``repeats`` times; the repeats are the outer
    loop, so each round measures every strategy side by side. Jobs of more than
    ``compile_up_to`` workers run eager (that many compiled processes do not fit in this
    machine's memory and time); the table says which. ``cells``: the (scenario, strategy)
    pairs to run (default: each of ``strategies`` in each of ``scenarios`` it has);
    ``table``: the result's Markdown (default ``downtime_table``); ``command``: the command
    line, recorded in the result."""
    for n in workers:
        if n not in LAYOUTS_BY_WORKERS:
            raise ValueError(f"--workers {n}: choose from {sorted(LAYOUTS_BY_WORKERS)}")
    if repeats < 1:
        raise ValueError(f"--repeats {repeats}: must be >= 1")
    cells = list(cells or ((sc, st) for sc in scenarios for st in strategies
                           if sc == "planned" or st in FAILURE_STRATEGIES))
    for sc, st in cells:
        if sc not in SCENARIOS or st not in (STRATEGIES if sc == "planned"
                                             else FAILURE_STRATEGIES):
            raise ValueError(f"no {sc!r} scenario for strategy {st!r}")
    rows = []
    scratch = scratch or tempfile.mkdtemp(prefix="tm-bench-downtime-")
    settings = {"event_step": event_step, "repeats": repeats, "compile": compile,
                "compile_up_to": compile_up_to, "command": command}
    table = table or downtime_table
    result = None
    line = BenchLine(f"bench {name}", repeats * len(workers) * len(cells))
    for rep in range(repeats):
        for n in workers:
            cfg = get_recipe("bench_downtime")
            cfg.layout = LAYOUTS_BY_WORKERS[n]
            cfg.train.compile = compile and (compile_up_to is None or n <= compile_up_to)
            # the benchmark's jobs run "forever" until it stops them: if the benchmark
            # process itself dies, their agents must not restart a controller for them
            cfg.controller.restart, cfg.controller.grace_s = "manual", 30.0
            cfg.validate()
            leaver = "w1"
            for scenario, strategy in cells:
                line.start(f"{scenario}, {strategy}, {n} workers, round {rep + 1}")
                t0 = time.perf_counter()
                run_dir = os.path.join(scratch, f"{scenario}-{strategy}-{n}-r{rep}")
                try:
                    res = _downtime_run(strategy, cfg, event_step, leaver, run_dir) \
                        if scenario == "planned" else \
                        _failure_run(strategy, scenario, cfg, event_step, leaver, run_dir)
                except RuntimeError as exc:
                    # one failed run is a result too (reported as such), not the end of
                    # the others
                    res = {"downtime_s": None, "error": str(exc)[:500]}
                rows.append({"scenario": scenario, "strategy": strategy, "workers": n,
                             "repeat": rep, "layout": cfg.layout.as_dict(),
                             "compile": cfg.train.compile,
                             "caches_at_start": CACHES[strategy],
                             "bench_wall_s": time.perf_counter() - t0, **res})
                line.finish(f"  round {rep + 1}/{repeats} {n:>2} workers {scenario:>7} "
                            f"{strategy:>15}: " + (
                                f"FAILED: {res['error']}" if "error" in res else
                                downtime_phrase(res["downtime_s"], res["downtime_noise_s"])))
                # written after every run: a long benchmark keeps what it measured so far
                result = downtime_result(rows, settings, scratch, {})
                write_result(out_dir, name, result, table(result), json_path)
    line.close()
    limits = {}
    for n in workers:
        sizes = [r["transfer_bytes"] for r in rows if r["workers"] == n and
                 r["scenario"] == "planned" and r["strategy"] == "trainmover" and
                 r.get("transfer_bytes")]
        if sizes:
            nbytes = int(statistics.median(sizes))
            limits[n] = {"bytes": nbytes, "seconds": p2p_seconds(nbytes)}
    result = downtime_result(rows, settings, scratch, limits)
    write_result(out_dir, name, result, table(result), json_path)
    return result


def _finite(values) -> list[float]:
    return [v for v in values if isinstance(v, (int, float))]


def downtime_result(rows: list[dict], settings: dict, scratch: str, limits: dict) -> dict:
    """The rows, summarised per cell (median, min, max over repeats) with the ratios."""
    cells = []
    keys = sorted({(r["scenario"], r["workers"], r["strategy"]) for r in rows},
                  key=lambda k: (SCENARIOS.index(k[0]), k[1], STRATEGIES.index(k[2])))
    for scenario, n, strategy in keys:
        mine = [r for r in rows if (r["scenario"], r["workers"], r["strategy"]) ==
                (scenario, n, strategy)]
        ok = [r for r in mine if r["downtime_s"] is not None]
        cell = {"scenario": scenario, "workers": n, "strategy": strategy,
                "runs": len(mine), "failed": len(mine) - len(ok),
                "compile": mine[0]["compile"]}
        if ok:
            down = [r["downtime_s"] for r in ok]
            cell["downtime_s"] = spread(down)
            cell["spread_exceeds_value"] = max(down) - min(down) > abs(statistics.median(down))
            for key in ("detection_latency_s", "first_step_ratio", "downtime_noise_s",
                        "normal_step_s"):
                vals = _finite(r.get(key) for r in ok)
                cell[key] = spread(vals) if vals else None
            steps = _finite(r["downtime_s"] / r["normal_step_s"] for r in ok
                            if r.get("normal_step_s"))
            cell["downtime_steps"] = spread(steps) if steps else None
            noise = cell["downtime_noise_s"]
            # the rule every place a downtime is read uses (core/accounting.py)
            cell["within_noise"] = within_noise(cell["downtime_s"]["median"],
                                                noise["median"] if noise else None)
            limit = limits.get(n)
            if limit and strategy == "trainmover" and scenario == "planned":
                cell["limit_s"] = limit["seconds"]
                if not cell["within_noise"]:   # a stall inside the noise has no ratio
                    cell["downtime_over_limit"] = spread([d / limit["seconds"] for d in down])
            groups = [(r["groups_rebuilt"], r["groups_total"]) for r in ok
                      if r.get("groups_rebuilt") is not None]
            cell["groups"] = f"{groups[0][0]}/{groups[0][1]}" if groups else "all"
        cells.append(cell)
    return {"benchmark": "downtime", **settings, "recipe": "bench_downtime",
            "cells": cells, "ratios": _ratios(cells), "growth": _growth(cells),
            "bandwidth": {str(n): {**v, "gb_per_s": v["bytes"] / v["seconds"] / 1e9}
                          for n, v in limits.items()},
            "results": rows, "machine": machine_description(), "commit": git_commit(),
            "scratch": scratch}


def _ratios(cells: list[dict]) -> list[dict]:
    """restart / strategy per scenario and size: the ratio of medians, with the range the
    extremes allow; where the strategy's downtime is within its noise, only a lower bound
    (restart over the noise) is honest."""
    by = {(c["scenario"], c["workers"], c["strategy"]): c for c in cells if "downtime_s" in c}
    out = []
    for (scenario, n, strategy), c in by.items():
        restart = by.get((scenario, n, "restart"))
        if strategy == "restart" or restart is None:
            continue
        r, d = restart["downtime_s"], c["downtime_s"]
        row = {"scenario": scenario, "workers": n, "strategy": strategy}
        if c["within_noise"] or d["median"] <= 0:
            noise = c["downtime_noise_s"]["median"] if c["downtime_noise_s"] else None
            row["within_noise"] = True
            row["at_least"] = r["median"] / noise if noise else None
        else:
            row["median"] = r["median"] / d["median"]
            row["min"] = r["min"] / d["max"] if d["max"] > 0 else None
            row["max"] = r["max"] / d["min"] if d["min"] > 0 else None
        out.append(row)
    return out


def _growth(cells: list[dict]) -> list[dict]:
    """Per scenario and strategy: downtime (seconds and normal steps) at each size over the
    smallest."""
    out = []
    for scenario in SCENARIOS:
        for strategy in STRATEGIES:
            mine = sorted((c for c in cells if c["scenario"] == scenario and
                           c["strategy"] == strategy and "downtime_s" in c),
                          key=lambda c: c["workers"])
            if len(mine) < 2:
                continue
            base = mine[0]
            for c in mine[1:]:
                row = {"scenario": scenario, "strategy": strategy,
                       "from": base["workers"], "to": c["workers"],
                       "compile": [base["compile"], c["compile"]],
                       # a downtime inside the noise (or clamped at 0) divides into nothing
                       "within_noise": [n for n, x in ((base["workers"], base),
                                                       (c["workers"], c))
                                        if x.get("within_noise") or
                                        x["downtime_s"]["median"] <= 0]}
                if not row["within_noise"]:
                    row["seconds"] = c["downtime_s"]["median"] / base["downtime_s"]["median"]
                    if base.get("downtime_steps") and c.get("downtime_steps"):
                        row["steps"] = c["downtime_steps"]["median"] / \
                            base["downtime_steps"]["median"]
                out.append(row)
    return out


def _fmt(s: dict | None, digits: int = 3) -> str:
    return fmt_spread(s, digits, "")


def downtime_table(r: dict) -> str:
    lines = [f"# bench downtime: trainmover vs baselines (event at step {r['event_step']}, "
             f"{r['repeats']} repeats, median (min-max))", "",
             "| scenario | workers | compiled | strategy | downtime (s) | in normal steps | "
             "step noise (s) | detection (s) | first step / normal step | downtime / "
             "physical limit | groups rebuilt |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in r["cells"]:
        if "downtime_s" not in c:
            lines.append(f"| {c['scenario']} | {c['workers']} | {c['compile']} | "
                         f"{c['strategy']} | all {c['runs']} runs failed | | | | | | |")
            continue
        note, noise = [], c["downtime_noise_s"]
        # inside the noise no figure is shown (a negative one would mean nothing): the words,
        # with the noise beside them; the measured values stay in the JSON
        down = downtime_value(c["downtime_s"]["median"], noise and noise["median"]) \
            if c["within_noise"] else _fmt(c["downtime_s"])
        if c["spread_exceeds_value"] and not c["within_noise"]:   # (no value shown there)
            note.append("spread exceeds the value")
        if c["failed"]:
            note.append(f"{c['failed']} of {c['runs']} runs failed")
        lines.append(
            f"| {c['scenario']} | {c['workers']} | {'yes' if c['compile'] else 'no'} | "
            f"{c['strategy']} | {down}"
            + (f" ({'; '.join(note)})" if note else "") +
            f" | {'-' if c['within_noise'] else _fmt(c['downtime_steps'], 2)} | "
            f"{_fmt(c['downtime_noise_s'])} | "
            f"{_fmt(c['detection_latency_s'])} | {_fmt(c['first_step_ratio'], 2)} | "
            + (f"{_fmt(c.get('downtime_over_limit'), 1)}" if c.get("downtime_over_limit")
               else f"no ratio (limit {c['limit_s'] * 1e3:.1f} ms)" if c.get("limit_s")
               else "") + f" | {c['groups']} |")
    lines += ["", "Restart's downtime over each strategy's (ratio of medians; range from the "
              "extremes):", ""]
    for x in r["ratios"]:
        what = f"- {x['scenario']}, {x['workers']} workers, restart / {x['strategy']}: "
        if x.get("within_noise"):
            lines.append(what + "the strategy's downtime is within step noise" +
                         (f"; restart is at least {x['at_least']:.0f}x that noise"
                          if x.get("at_least") else ""))
        else:
            rng = (f" ({x['min']:.1f}-{x['max']:.1f})" if x.get("min") and x.get("max")
                   else "")
            lines.append(what + f"{x['median']:.1f}x{rng}")
    if r["growth"]:
        lines += ["", "Growth with the job's size (median over median):", ""]
        for g in r["growth"]:
            parts = []
            if "seconds" in g:
                parts.append(f"{g['seconds']:.2f}x in seconds")
            if "steps" in g:
                parts.append(f"{g['steps']:.2f}x in normal steps")
            noise = g.get("within_noise") or []
            lines.append(f"- {g['scenario']} {g['strategy']}, {g['from']} -> {g['to']} "
                         f"workers: " + (", ".join(parts) or "no ratio: within step noise at "
                                         + " and ".join(str(n) for n in noise) + " workers") +
                         ("" if all(g["compile"]) else
                          " (eager at " + ", ".join(str(n) for n, c in
                                                    zip((g['from'], g['to']), g['compile'])
                                                    if not c) + " workers)"))
    if r["bandwidth"]:
        lines += ["", "Point-to-point bandwidth on this machine (gloo, one buffer the size of "
                  "the migration's transfer, round trip): " +
                  ", ".join(f"{n} workers: {v['bytes'] / 1e6:.1f} MB in {v['seconds']:.4f} s "
                            f"({v['gb_per_s']:.2f} GB/s)" for n, v in r["bandwidth"].items())
                  + ". The physical limit of a planned migration is that time plus no extra "
                  "step."]
    lines += ["", "Phases (seconds, medians):", ""]
    for c in r["cells"]:
        phases = {}
        for row in r["results"]:
            if (row["scenario"], row["workers"], row["strategy"]) == \
                    (c["scenario"], c["workers"], c["strategy"]) and row["downtime_s"] is not None:
                for k, v in row["phases"].items():
                    if isinstance(v, (int, float)):
                        phases.setdefault(k, []).append(v)
        if phases:
            lines.append(f"- {c['scenario']}, {c['workers']} workers, {c['strategy']}: " +
                         ", ".join(f"{k} {statistics.median(v):.3f}" for k, v in phases.items()))
    lines += ["", "Caches each strategy starts with:", ""]
    lines += [f"- {k}: {v}" for k, v in CACHES.items()]
    m = r["machine"]
    lines += ["", f"machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}; commit "
              f"{r.get('commit')}"]
    return "\n".join(lines) + "\n"
