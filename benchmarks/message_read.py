"""What reading and writing one control message costs (``protocol.read_message``,
``write_message``): the controller reads a failure report per survivor in a recovery and a
beat per host every health check; every agent writes its host's beat every heartbeat
interval and each window's step measurements.

    python benchmarks/message_read.py --reads 20000 --repeats 5 [--out DIR]

Times ``read_message`` and ``write_message`` of a ``FailureReport`` (three groups' operation
counts, as a worker of a DP x PP x TP job sends), a ``HostBeat`` of a host with 8 processes
listed quiet and a ``StepPerf`` with its 8 windows, against ``json.loads`` of the same bytes
(the parse alone). Runs against whatever commit it sits in. Prints microseconds per read and
per write; with ``--out`` also writes ``NAME.{md,json}`` there."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trainmover.bench.report import git_commit, machine_description, write_result  # noqa: E402
from trainmover.core import protocol as P  # noqa: E402


def _messages() -> dict:
    report = P.FailureReport(
        step=10, error="epoch 1 aborted: w3 crash", self_failed=False,
        accounting={g: {"sent": 5, "recv": 5, "coll": 30, "gen": 1}
                    for g in ("tp.dp0.pp0", "dp.pp0.tp0", "pp.dp0.tp0")})
    beat = P.HostBeat(pid=1234, seq=99, running=8,
                      quiet={f"w{i}": [4000 + i, 1700] for i in range(8)})
    perf = P.StepPerf("dp0.pp1.tp2", 10, 19, 0, 0.2, 0.2, {"dp": 0.01, "tp": 0.002},
                      recent=[P.PerfWindow(10 * i, 10 * i + 9, 0.2) for i in range(8)])
    return {name: (type(msg), msg) for name, msg in
            (("FailureReport", report), ("HostBeat", beat), ("StepPerf", perf))}


def _per_read_us(fn, reads: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reads):
        fn()
    return (time.perf_counter() - t0) / reads * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reads", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--name", default="message_read")
    args = ap.parse_args()
    if args.repeats < 3 or args.reads < 1:
        raise SystemExit(f"--repeats {args.repeats} (at least 3), --reads {args.reads} (> 0)")
    rows = []
    for name, (cls, msg) in _messages().items():
        raw = P.write_message(msg)
        write = [_per_read_us(lambda: P.write_message(msg), args.reads)
                 for _ in range(args.repeats)]
        read = [_per_read_us(lambda: P.read_message(cls, raw), args.reads)
                for _ in range(args.repeats)]
        parse = [_per_read_us(lambda: json.loads(raw), args.reads) for _ in range(args.repeats)]
        rows.append({"message": name, "bytes": len(raw),
                     "read_us": {"median": statistics.median(read), "min": min(read),
                                 "max": max(read)},
                     "parse_us": {"median": statistics.median(parse), "min": min(parse),
                                  "max": max(parse)},
                     "write_us": {"median": statistics.median(write), "min": min(write),
                                  "max": max(write)}})
        r = rows[-1]
        print(f"{name} ({len(raw)} B): read {r['read_us']['median']:.1f} us "
              f"({r['read_us']['min']:.1f}-{r['read_us']['max']:.1f}), json.loads "
              f"{r['parse_us']['median']:.1f} us, write {r['write_us']['median']:.1f} us "
              f"({r['write_us']['min']:.1f}-{r['write_us']['max']:.1f})", flush=True)
    if args.out:
        cmd = " ".join(["python benchmarks/message_read.py"] + sys.argv[1:])
        result = {"benchmark": "message_read", "rows": rows, "reads": args.reads,
                  "repeats": args.repeats, "command": cmd, "commit": git_commit(),
                  "machine": machine_description()}
        lines = [f"# One control message read and written ({args.repeats} repeats of "
                 f"{args.reads}, median (min-max) us each)", "", f"command: `{cmd}`; commit "
                 f"{result['commit']}", "", "| message | bytes | read_message (us) | "
                 "json.loads alone (us) | write_message (us) |", "|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['message']} | {r['bytes']} | {r['read_us']['median']:.1f} "
                         f"({r['read_us']['min']:.1f}-{r['read_us']['max']:.1f}) | "
                         f"{r['parse_us']['median']:.1f} | {r['write_us']['median']:.1f} "
                         f"({r['write_us']['min']:.1f}-{r['write_us']['max']:.1f}) |")
        write_result(args.out, args.name, result, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
