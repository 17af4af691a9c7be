"""Where the controller's supervision rounds spend their time, part by part, in a simulated
job (``trainmover bench control``: steps, a crash and its recovery, a planned migration).

    PYTHONPATH=TREE python benchmarks/round_parts.py --workers 4096 --repeats 3 \
        [--sim-procs 2] [--out DIR] [--name round_parts] [-- BENCH CONTROL OVERRIDES ...]

It runs the tree on ``PYTHONPATH`` (so one copy of this script measures a commit before a
change and after it), times each of the round's parts (the drivers' polls, the snapshot's
encoding and saving, the status write, the deletion of dead keys) and counts the store
requests the round's thread makes, by kind, in every round of the whole run (the
recovery's and the migration's included, which ``bench control``'s steady window leaves
out). A part the tree does not have is left out. Per repeat: each part's mean, p99 and
max over the rounds, and the round's; the table gives their medians (min-max) over the
repeats. Writes ``NAME.{md,json}`` under ``--out``.

    python benchmarks/round_parts.py --compare BEFORE.json AFTER.json --out DIR --name NAME

puts two such results side by side (each part: mean, p99 and max, before -> after)."""
from __future__ import annotations

import argparse
import collections
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

# after PYTHONPATH: the tree it names is the one measured
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trainmover.bench import control as BC  # noqa: E402
from trainmover.bench.main import WARMUP_STEPS  # noqa: E402
from trainmover.bench.report import git_commit, machine_description, write_result  # noqa: E402
from trainmover.control import saving  # noqa: E402
from trainmover.core import kvstore  # noqa: E402

# (the object's path from the controller, method): the parts of a round timed
PARTS = [("", "_check_incarnation"), ("", "_beat"), ("ctx.procs", "refresh"),
         ("ctx.progress", "poll"), ("watch", "check_exits"), ("watch", "update_standbys"),
         ("health", "hung_standbys"), ("watch", "replenish"), ("recovery", "poll"),
         ("migrations", "collect"), ("stopping", "collect"), ("stragglers", "poll"),
         ("rebalancer", "poll"), ("migrations", "poll"), ("migrations", "finish_downtimes"),
         ("recovery", "finish_downtimes"), ("stopping", "poll"), ("retention", "poll"),
         ("replicas", "poll"), ("saver", "flush"), ("saver", "_write_status"),
         ("saver", "_save_file"), ("retention", "snapshot_saved")]
CONTROLLER_THREAD = "controller"      # bench control's name for the controller's thread


class Recorder:
    """Per round: each part's seconds and the controller thread's store requests."""

    def __init__(self):
        self.rounds: list[dict[str, float]] = []
        self.now: collections.Counter = collections.Counter()

    def timed(self, obj, name: str, label: str) -> None:
        inner = getattr(obj, name)

        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.now[label] += time.perf_counter() - t
        setattr(obj, name, wrapper)

    def install(self) -> None:
        rec = self
        call = kvstore.KVClient._call

        def counted(client, op, *args, **kwargs):
            if threading.current_thread().name != CONTROLLER_THREAD:
                return call(client, op, *args, **kwargs)
            t = time.perf_counter()
            try:
                return call(client, op, *args, **kwargs)
            finally:
                rec.now["requests"] += 1
                rec.now["requests_s"] += time.perf_counter() - t
                rec.now[f"requests {op.name}"] += 1
        kvstore.KVClient._call = counted
        codec = saving.SNAPSHOT_CODEC
        self.timed(codec, "dumps", "snapshot encode")

        poll, flush = BC.SimCoordinator._poll, BC.SimCoordinator._flush

        def polled(coord):
            if not getattr(coord, "_parts_timed", False):
                coord._parts_timed = True
                for path, name in PARTS:
                    obj = coord
                    for attr in filter(None, path.split(".")):
                        obj = getattr(obj, attr, None)
                    if obj is not None and hasattr(obj, name):
                        rec.timed(obj, name, f"{path or 'coordinator'}.{name}")
            rec.now.clear()
            return poll(coord)

        def flushed(coord, force=False):
            flush(coord, force)
            if coord.rounds:
                _, wall, cpu = coord.rounds[-1]
                rec.rounds.append({"round": wall, "round CPU": cpu, **rec.now})
        BC.SimCoordinator._poll, BC.SimCoordinator._flush = polled, flushed


def summary(rounds: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Each part's mean, p99 and max over ``rounds`` (a round without it: 0)."""
    names = sorted({k for r in rounds for k in r})
    out = {}
    for name in names:
        values = sorted(r.get(name, 0.0) for r in rounds)
        out[name] = {"mean": sum(values) / len(values),
                     "p99": values[min(len(values) - 1, int(0.99 * len(values)))],
                     "max": values[-1]}
    return out


def _cell(runs: list[dict], name: str, what: str) -> str:
    """The median (min-max) over ``runs`` of part ``name``'s ``what`` (ms, or a count)."""
    values = [run["parts"].get(name, {}).get(what, 0.0) for run in runs]
    scale, digits = (1.0, 0) if name.startswith("requests") and \
        not name.endswith("_s") else (1e3, 1)
    med = statistics.median(values) * scale
    return f"{med:.{digits}f} ({min(values) * scale:.{digits}f}-{max(values) * scale:.{digits}f})"


def _by_mean(results: list[dict]) -> list[str]:
    """Every part of ``results``, the costliest on average (in the first) first."""
    names = {k for res in results for run in res["runs"] for k in run["parts"]}
    return sorted(names, key=lambda k: -statistics.median(
        run["parts"].get(k, {}).get("mean", 0.0) for run in results[0]["runs"]))


def compare(paths: list[str], out: str, name: str) -> None:
    import json

    before, after = (json.load(open(p)) for p in paths)
    lines = [f"# The controller's round, part by part, before and after: {before['workers']} "
             f"simulated workers", "",
             f"- before: commit {before['commit']}: `{before['command']}`",
             f"- after: commit {after['commit']}: `{after['command']}`", "",
             f"Each run on {before['machine']['cores']} cores, {len(before['runs'])} and "
             f"{len(after['runs'])} repeats: median (min-max) of each repeat's figure over "
             f"all its rounds (steps, a crash's recovery, a planned migration). Times in ms, "
             f"requests as counts (the controller thread's store requests in a round).", "",
             "| part | mean before | after | p99 before | after | max before | after |",
             "|---|---|---|---|---|---|---|"]
    for n in _by_mean([before, after]):
        lines.append(f"| {n} | " + " | ".join(
            _cell(res["runs"], n, what) for what in ("mean", "p99", "max")
            for res in (before, after)) + " |")
    write_result(out, name, {"benchmark": "round_parts_compare", "before": before,
                             "after": after}, "\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sim-procs", type=int, default=2)
    ap.add_argument("--compute-s", type=float, default=0.2)
    ap.add_argument("--timeout-s", type=float, default=900.0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--name", default="round_parts")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), default=None,
                    help="two results of this script, side by side (nothing is run)")
    ap.add_argument("overrides", nargs="*", help="the simulated job's settings, as "
                    "bench control takes them (health.silence_floor_s=5)")
    args = ap.parse_args()
    if args.compare:
        if not args.out:
            raise SystemExit("--compare writes its table under --out DIR")
        compare(args.compare, args.out, args.name)
        return
    if args.repeats < 3 or args.workers < 1:
        raise SystemExit(f"--repeats {args.repeats} (at least 3) / --workers {args.workers} "
                         f"(positive)")
    overrides = [tuple(o.split("=", 1)) for o in args.overrides]
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        raise SystemExit(f"settings are NAME=VALUE: {bad}")
    rec = Recorder()
    rec.install()
    runs = []
    for i in range(args.repeats):
        rec.rounds = []
        work_dir = tempfile.mkdtemp(prefix="tm-round-parts-")
        try:        # bench control's defaults: its warm-up, steady steps, standbys, hosts
            BC.run_once(args.workers, args.compute_s, WARMUP_STEPS, 10, WARMUP_STEPS, 2,
                        args.timeout_s, work_dir, full_hosts=4, overrides=overrides,
                        sim_procs=args.sim_procs)
        finally:
            shutil.rmtree(work_dir, ignore_errors=True)
        runs.append({"rounds": len(rec.rounds), "parts": summary(rec.rounds)})
        r = runs[-1]["parts"]
        print(f"repeat {i + 1}/{args.repeats}: {runs[-1]['rounds']} rounds, round p99 "
              f"{r['round']['p99'] * 1e3:.1f} ms, max {r['round']['max'] * 1e3:.1f} ms, "
              f"requests a round max {r['requests']['max']:.0f}", flush=True)
    commit = git_commit()
    cmd = " ".join(["python benchmarks/round_parts.py"] + sys.argv[1:])
    result = {"benchmark": "round_parts", "command": cmd, "commit": commit,
              "machine": machine_description(), "workers": args.workers, "runs": runs}
    lines = [f"# The controller's round, part by part: {args.workers} simulated workers",
             "", f"command: `PYTHONPATH=<tree at {commit}> {cmd}`; commit {commit}; "
             f"{result['machine']['cores']} cores; {args.repeats} repeats, median (min-max) "
             f"of each repeat's figure over all its rounds (steps, a crash's recovery, a "
             f"planned migration). Times in ms, requests as counts (the controller "
             f"thread's store requests in a round).", "",
             "| part | mean | p99 | max |", "|---|---|---|---|"]
    lines += [f"| {n} | " + " | ".join(_cell(runs, n, w) for w in ("mean", "p99", "max")) + " |"
              for n in _by_mean([result])]
    table = "\n".join(lines) + "\n"
    if args.out:
        write_result(args.out, args.name, result, table)
    else:
        print(table)


if __name__ == "__main__":
    main()
