"""What one write of ``status.json`` costs the controller, against the number of workers.

    python benchmarks/status_write.py --workers 2048,16384 --repeats 7 [--out DIR]

The controller's own path (``Saver._write_status`` in control/saving.py: each worker's
newest step measurements, ``status_from_state``, ``write_status_file``) on a state as its
snapshot holds it, every worker with a full ``StepPerf`` (its history of windows included),
written to a temporary run dir. It runs against whatever commit it sits in: at one from before the
status was encoded by json's own encoder it takes that commit's path (``asdict`` of each
worker's measurements, the PID probes), so the same script gives the before and after
figures. Prints one line per size; with ``--out`` also writes ``NAME.{md,json}`` there."""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace as NS

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trainmover.bench.report import git_commit, machine_description, write_result  # noqa: E402
from trainmover.control import status as S  # noqa: E402
from trainmover.control.processes import ProcView  # noqa: E402
from trainmover.core import protocol as P  # noqa: E402


def _perf() -> P.StepPerf:
    windows = [P.PerfWindow(i * 10 + 1, i * 10 + 10, 0.19) for i in range(P.PERF_HISTORY)]
    return P.StepPerf(role="dp0.pp0.tp0", first_step=1, last_step=10, tenure_start=0,
                      step_s=0.2, compute_s=0.19, wait_s={"dp": 0.01, "tp": 0.0, "pp_next": 0.0},
                      load1=1.0, steal=0.0, recent=windows)


def _write(run_dir: str, state: dict, latest: dict) -> None:
    """The controller's status write, as this commit does it."""
    if hasattr(S, "status_perf"):
        perf = {w: S.status_perf(p) for w, p in latest.items()}
        st = S.status_from_state(state, perf, os.getpid(), 100, source="controller",
                                 recorded=True)
    else:
        perf = {w: dataclasses.asdict(p) for w, p in latest.items()}
        st = S.status_from_state(state, perf, os.getpid(), 100, source="controller")
    S.write_status_file(run_dir, st)


def measure(n: int, repeats: int) -> dict:
    pid = os.getpid()       # alive: the former path probes it for every worker
    state = {"ctx": {"procs": NS(procs={f"w{i}": ProcView(False, 1, i // 8, pid, None)
                                        for i in range(n)}),
                     "membership": NS(workers={f"w{i}": NS(name=f"dp{i}.pp0.tp0")
                                               for i in range(n)}, standbys={}),
                     "committed": 5, "epoch": 1},
             "migrations": {"active": None, "finished": []},
             "recovery": {"active": None, "done": []}}
    latest = {f"w{i}": _perf() for i in range(n)}
    times = []
    with tempfile.TemporaryDirectory() as run_dir:
        for _ in range(repeats):
            t0 = time.perf_counter()
            _write(run_dir, state, latest)
            times.append(time.perf_counter() - t0)
        size = os.path.getsize(os.path.join(run_dir, S.STATUS_FILE))
    return {"workers": n, "median_s": statistics.median(times), "min_s": min(times),
            "max_s": max(times), "file_bytes": size}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", default="2048,16384")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=None)
    ap.add_argument("--name", default="status_write")
    args = ap.parse_args()
    sizes = [int(x) for x in args.workers.split(",")]
    if args.repeats < 3 or any(n < 1 for n in sizes):
        raise SystemExit(f"--repeats {args.repeats} (at least 3) / --workers {args.workers} "
                         f"(positive)")
    rows = []
    for n in sizes:
        rows.append(measure(n, args.repeats))
        r = rows[-1]
        print(f"{n} workers: {r['median_s'] * 1e3:.1f} ms ({r['min_s'] * 1e3:.1f}-"
              f"{r['max_s'] * 1e3:.1f}), {r['file_bytes'] / 1e6:.2f} MB", flush=True)
    if args.out:
        cmd = " ".join(["python benchmarks/status_write.py"] + sys.argv[1:])
        result = {"benchmark": "status_write", "rows": rows, "repeats": args.repeats,
                  "command": cmd, "commit": git_commit(), "machine": machine_description()}
        lines = [f"# status.json: one write by the controller ({args.repeats} repeats, "
                 f"median (min-max))", "", f"command: `{cmd}`; commit {result['commit']}", "",
                 "| workers | write (ms) | file (MB) |", "|---|---|---|"]
        lines += [f"| {r['workers']} | {r['median_s'] * 1e3:.1f} ({r['min_s'] * 1e3:.1f}-"
                  f"{r['max_s'] * 1e3:.1f}) | {r['file_bytes'] / 1e6:.2f} |" for r in rows]
        write_result(args.out, args.name, result, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
