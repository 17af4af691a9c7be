"""What one write of ``status.json`` costs the controller, against the number of workers.

    python benchmarks/status_write.py --workers 2048,16384 --repeats 7 [--out DIR]

The controller's own path (``Saver._write_status`` in control/saving.py) on a state as its
snapshot holds it, every worker with its step measurements as the controller holds them
between writes, written to a temporary run dir. It runs against whatever commit it sits in
(``PYTHONPATH=<tree>``): the columns of ``control/status_file.py`` where the commit has
them, else one object a worker (``status_from_state``; before the status was encoded by
json's own encoder, ``asdict`` of each worker's measurements and the PID probes), so the
same script gives the before and after figures (copied into the other tree: it runs the
tree it sits in). Prints one line per size; with ``--out`` also writes ``NAME.{md,json}``
there."""
from __future__ import annotations

import argparse
import dataclasses
import os
import random
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

try:                  # the status file's own module (columns), where the commit has it
    from trainmover.control import status_file as F  # noqa: E402
except ImportError:
    F = None


def _perf(role: str, rng: random.Random) -> P.StepPerf:
    """A worker's measurements as a job's would be: times with all their digits."""
    windows = [P.PerfWindow(i * 10 + 1, i * 10 + 10, rng.uniform(0.15, 0.25))
               for i in range(P.PERF_HISTORY)]
    return P.StepPerf(role=role, first_step=1, last_step=10, tenure_start=0,
                      step_s=rng.uniform(0.15, 0.25), compute_s=rng.uniform(0.15, 0.25),
                      wait_s={"dp": rng.uniform(0, 0.01), "tp": rng.uniform(0, 0.01),
                              "pp_next": 0.0}, load1=1.0, steal=0.0, recent=windows)


def _held(latest: dict) -> dict:
    """Each worker's measurements as the controller holds them between writes (since the
    status showed only the newest window: ``status_perf``, made by the straggler feed as it
    reads them, not by the write)."""
    if hasattr(S, "status_perf"):
        return {w: S.status_perf(p) for w, p in latest.items()}
    return latest


def _write(run_dir: str, state: dict, held: dict) -> None:
    """The controller's status write, as this commit does it (``Saver._write_status``)."""
    if F is not None:
        data = F.status_columns(state, held, os.getpid(), 100, source="controller",
                                recorded=True)
        F.write_status_file(run_dir, data)
        return
    if hasattr(S, "status_perf"):
        st = S.status_from_state(state, held, os.getpid(), 100, source="controller",
                                 recorded=True)
    else:
        perf = {w: dataclasses.asdict(p) for w, p in held.items()}
        st = S.status_from_state(state, perf, os.getpid(), 100, source="controller")
    S.write_status_file(run_dir, st)


def measure(n: int, repeats: int) -> dict:
    pid = os.getpid()       # alive: the former path probes it for every worker
    roles = {f"w{i}": f"dp{i}.pp0.tp0" for i in range(n)}
    state = {"ctx": {"procs": NS(procs={f"w{i}": ProcView(False, 1, i // 8, pid, None)
                                        for i in range(n)}),
                     "membership": NS(workers={w: NS(name=r) for w, r in roles.items()},
                                      standbys={}),
                     "committed": 5, "epoch": 1},
             "migrations": {"active": None, "finished": []},
             "recovery": {"active": None, "done": []}}
    rng = random.Random(0)
    held = _held({w: _perf(r, rng) for w, r in roles.items()})
    times = []
    with tempfile.TemporaryDirectory() as run_dir:
        for _ in range(repeats):
            t0 = time.perf_counter()
            _write(run_dir, state, held)
            times.append(time.perf_counter() - t0)
        size = os.path.getsize(os.path.join(run_dir, S.STATUS_FILE if F is None
                                            else F.STATUS_FILE))
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
