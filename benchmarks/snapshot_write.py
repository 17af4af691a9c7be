"""The controller's snapshot save, whole, against the number of workers (issue #24), in the
code of a source tree. Run it once per tree (e.g. a `git worktree` checkout of an older
commit) to compare them:

    PYTHONPATH=TREE python benchmarks/snapshot_write.py [--sizes 1024,...] [--repeats 3]

What it drives: the tree's own ``control.saving.Saver.flush`` (a busy round's save: encoded,
written to the run dir's copy and to the store's) over the tree's signed store client, to a
store served by its own process (``trainmover.bench.control_store``, as a job's is served by
host 0's agent), with the state of ``benchmarks/snapshot_save.py`` (the membership, the
process table, each process's host, each host's command counter, a recovery with half the
survivors' reports). ``status.json`` is not written (``benchmarks/status_write.py``).

Columns, each a median (min-max) over the repeats:
- ``first save (ms)``: the first save of the state (every part encoded and written);
- ``save after a change (ms)``: a save after one process's record changed, and after one
  more report came (the two kinds of change of a recovery's busy rounds), 4 saves a repeat;
- ``store / file KB a save``: the bytes those saves sent to the store (values, as sent) and
  wrote to the run dir.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from snapshot_save import state_of  # noqa: E402

from trainmover.control.saving import Saver  # noqa: E402
from trainmover.core import jobfile, kvstore, rundir  # noqa: E402
from trainmover.core import protocol as P  # noqa: E402
from trainmover.core.auth import AuthStore, create_secret  # noqa: E402
from trainmover.core.config import JobConfig  # noqa: E402


class Counting:
    """A store client's writing methods, counting the bytes of the values sent."""

    def __init__(self, raw):
        self.raw, self.bytes = raw, 0

    def __getattr__(self, name):
        return getattr(self.raw, name)

    def set(self, key, value):
        self.bytes += len(value)
        return self.raw.set(key, value)

    def multi_set(self, keys, values):
        self.bytes += sum(len(v) for v in values)
        return self.raw.multi_set(keys, values)


class Files:
    """``rundir.write_atomic``, counting the bytes written."""

    def __init__(self):
        self.bytes = 0
        self.real = rundir.write_atomic
        rundir.write_atomic = self

    def __call__(self, path, data):
        self.bytes += len(data)
        return self.real(path, data)


def store_process(run_dir: str) -> tuple[subprocess.Popen, int]:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainmover.bench.control_store", "--run-dir", run_dir,
         "--listen-fd", str(listener.fileno()), "--stats", os.path.join(run_dir, "..", "s")],
        pass_fds=[listener.fileno()])
    listener.close()
    return proc, port


def measure(n: int, scratch: str, files: Files) -> dict:
    run_dir = os.path.join(scratch, f"run{n}-{time.monotonic_ns()}")
    rundir.create(run_dir)
    cfg = JobConfig()
    secret = create_secret(run_dir)
    jobfile.write_job(run_dir, cfg, secret)
    run_key = jobfile.start_run(run_dir, secret)
    proc, port = store_process(run_dir)
    try:
        raw = Counting(kvstore.connect("127.0.0.1", port, run_key, 30.0, 30.0))
        ctx = SimpleNamespace(cfg=cfg, store=AuthStore(raw, run_key), outbox=[],
                              procs=SimpleNamespace(exits_seen=0),
                              events=SimpleNamespace(emit=lambda *a, **k: None))
        state = state_of(n)
        saver = Saver(ctx, run_dir, lambda: state,
                      SimpleNamespace(snapshot_saved=lambda exits: None), lambda: {})
        saver.run_key = run_key
        saver._status_at = float("inf")        # status.json: not this benchmark's
        t0 = time.perf_counter()
        saver.flush(force=True, busy=True)
        first = (time.perf_counter() - t0) * 1000
        times, store_kb, file_kb = [], [], []
        procs, reports = state["procs"].procs, state["recovery"].reports
        for k in range(4):
            if k % 2 == 0:
                name = f"w{5 + k}"
                procs[name] = dataclasses.replace(procs[name], code=1)
            else:
                reports[f"w{n - 1 - k}"] = P.FailureReport(6, "aborted", False, {})
            raw.bytes = files.bytes = 0
            t0 = time.perf_counter()
            saver.flush(force=True, busy=True)
            times.append((time.perf_counter() - t0) * 1000)
            store_kb.append(raw.bytes / 1e3)
            file_kb.append(files.bytes / 1e3)
        return {"first_ms": first, "save_ms": times, "store_kb": store_kb, "file_kb": file_kb}
    finally:
        proc.kill()
        proc.wait()


def cell(values: list[float], digits: int = 1) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-" \
           f"{max(values):.{digits}f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1024,4096,16384,65536")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=os.path.dirname(os.path.abspath(
                                sys.modules["trainmover"].__file__))).stdout.strip()
    files = Files()
    rows = []
    scratch = tempfile.mkdtemp(prefix="snapwrite-")
    for n in [int(s) for s in args.sizes.split(",")]:
        runs = [measure(n, scratch, files) for _ in range(args.repeats)]
        rows.append({"workers": n, "runs": runs})
    print(f"commit {commit}")
    print("| workers | first save (ms) | save after a change (ms) | store KB a save | "
          "file KB a save |")
    print("|---|---|---|---|---|")
    for row in rows:
        runs = row["runs"]
        print(f"| {row['workers']} | {cell([r['first_ms'] for r in runs])} | "
              f"{cell([t for r in runs for t in r['save_ms']])} | "
              f"{cell([b for r in runs for b in r['store_kb']], 0)} | "
              f"{cell([b for r in runs for b in r['file_kb']], 0)} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"commit": commit, "rows": rows}, f)


if __name__ == "__main__":
    main()
