"""What the survivors' failure reports of one recovery cost the job's store and the
controller, in the code of a source tree: one report a worker (older trees), or one
``HostReports`` a host of 8 (trees with ``agent/reports.py``) (issue #24: the term of a
crash's control time that grows with N once the rest is by host). Run it once per tree
(``PYTHONPATH=TREE``) to compare them.

    python benchmarks/report_cost.py --workers 2048,16384 --repeats 3 [--out DIR]

The store (``core/kvserver.py``, one thread, as a job's) runs in a process of its own. Each
survivor's report is written as the tree writes it: its signed ``FailureReport`` (the
accounting of 3 groups, as a DP x PP x TP worker's) at its key and one ``add`` to the
epoch's count (``worker/recover.report_failure`` of older trees), or each host's 8 in one
signed ``HostReports`` and one ``add`` of 8 (``agent/reports.py``), from 8 client
connections in turn (the store sees the same requests; the clients' own time is not
counted). Measured: the store process's CPU
for those 2N requests (from /proc), and the controller's ``read_failure_reports`` of every
survivor (``control/health.py``: batched reads, signatures checked, messages decoded) on
this process's CPU. Then the same survivors' notes that their part of the recovery is done,
as the tree sends them: one ``add`` to the recovery's count a worker (older trees), or one
a host (trees with ``P.recovered_message``: the agent adds its host's number), after
setting its host's signed ``HostRecovered`` (trees with it); measured: the store process's
CPU for them, and the controller's read of the notes (``control/host_notes.py``). Prints
seconds per recovery."""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.store_process import cpu_s, store_process  # noqa: E402
from trainmover.bench.report import git_commit, machine_description, write_result  # noqa: E402
try:  # noqa: E402
    from trainmover.control.host_notes import read_failure_reports, read_recovery_notes
except ImportError:          # older trees
    from trainmover.control.health import read_failure_reports
from trainmover.core import kvstore  # noqa: E402
from trainmover.core import protocol as P  # noqa: E402
from trainmover.core.auth import AuthStore  # noqa: E402

KEY = b"r" * 32
CLIENTS = 8
PER_HOST = 8
HOST_FORM = hasattr(P, "HostReports")
NOTES_BY_HOST = hasattr(P, "recovered_message")
NOTES_SIGNED = hasattr(P, "HostRecovered")


def report(step: int) -> bytes:
    acct = {"coll": 812, "sent": 0, "recv": 0, "pending": 1, "generation": 0}
    return P.write_message(P.FailureReport(step, "aborted: a peer failed", False,
                                           {"dp.pp3.tp5": acct, "tp.dp7.pp3": acct,
                                            "p2p.dp7.tp5.pp3-4": acct}))


def measure(server, port: int, n: int, epoch: int) -> dict:
    stores = [AuthStore(kvstore.connect("127.0.0.1", port, KEY, 60.0), KEY)
              for _ in range(CLIENTS)]
    workers = [f"w{i}" for i in range(n)]
    payload = report(41)
    hosts = {w: i // PER_HOST for i, w in enumerate(workers)}
    one = P.read_message(P.FailureReport, payload)
    before = cpu_s(server.pid)
    requests = 0
    if HOST_FORM:
        for node in range(n // PER_HOST):
            store = stores[node % CLIENTS]
            names = workers[node * PER_HOST:(node + 1) * PER_HOST]
            store.set(P.host_reports_key(node, epoch), P.write_message(
                P.HostReports(epoch, {w: one for w in names})))
            store.add(P.failure_count_key(epoch), len(names))
            requests += 2
    else:
        for i, w in enumerate(workers):
            store = stores[i % CLIENTS]
            store.set(P.failure_key(epoch, w), payload)
            store.add(P.failure_count_key(epoch), 1)
            requests += 2
    stores[0].check(["x"])        # every request above answered before the reading
    store_cpu = cpu_s(server.pid) - before
    ctx = SimpleNamespace(store=stores[0], hosts=hosts,
                          events=SimpleNamespace(emit=lambda *a, **k: None))
    t0, c0 = time.perf_counter(), time.process_time()
    got = read_failure_reports(ctx, epoch, workers)
    read_s, read_cpu = time.perf_counter() - t0, time.process_time() - c0
    assert len(got) == n
    before, notes = cpu_s(server.pid), 0
    for i in range(0, n, PER_HOST if NOTES_BY_HOST else 1):
        store = stores[notes % CLIENTS]
        if NOTES_SIGNED:
            store.set(P.host_recovered_key(i // PER_HOST, epoch), P.write_message(
                P.HostRecovered(epoch, workers[i:i + PER_HOST])))
        store.add(P.recovered_count_key(epoch), PER_HOST if NOTES_BY_HOST else 1)
        notes += 1
    assert stores[0].add(P.recovered_count_key(epoch), 0) == n
    stores[0].check(["x"])
    notes_cpu = cpu_s(server.pid) - before
    notes_read_s = None
    if NOTES_SIGNED:
        t0 = time.perf_counter()
        assert len(read_recovery_notes(ctx, epoch, workers)) == n
        notes_read_s = time.perf_counter() - t0
    for s in stores:
        s.raw.close()
    return {"store_cpu_s": store_cpu, "read_s": read_s, "read_cpu_s": read_cpu,
            "bytes": n * len(payload), "requests": requests,
            "notes_requests": notes * (2 if NOTES_SIGNED else 1),
            "notes_store_cpu_s": notes_cpu, "notes_read_s": notes_read_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", default="2048,16384")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", help="write NAME.md/.json here")
    ap.add_argument("--name", default="report_cost")
    args = ap.parse_args()
    rows, epoch = [], 0
    with store_process(KEY) as (server, port):
        for n in [int(x) for x in args.workers.split(",")]:
            runs = []
            for _ in range(args.repeats):
                epoch += 1
                runs.append(measure(server, port, n, epoch))
            rows.append({"workers": n, "runs": runs})

    def cell(key, n_digits=3):
        return lambda runs: (f"{statistics.median(r[key] for r in runs):.{n_digits}f} "
                             f"({min(r[key] for r in runs):.{n_digits}f}-"
                             f"{max(r[key] for r in runs):.{n_digits}f})")
    lines = ["# The survivors' failure reports of one recovery: the store's and the "
             "controller's cost", "",
             f"`python benchmarks/report_cost.py --workers {args.workers} --repeats "
             f"{args.repeats}`; commit {git_commit()}; {machine_description()['cores']} "
             f"cores; reports {'by host' if HOST_FORM else 'by worker'}, notes of a recovery "
             f"done {'by host' if NOTES_BY_HOST else 'by worker'}. Median (min-max) "
             f"over the repeats (the module doc says what is measured).", "",
             "| survivors | requests at the store | store CPU (s) | controller's read (s) | "
             "its CPU (s) | report bytes (MB) | notes: requests | notes: store CPU (s) | "
             "notes: controller's read (s) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        runs = row["runs"]
        lines.append(f"| {row['workers']} | {runs[0]['requests']} | "
                     f"{cell('store_cpu_s')(runs)} | {cell('read_s')(runs)} | "
                     f"{cell('read_cpu_s')(runs)} | {runs[0]['bytes'] / 1e6:.2f} | "
                     f"{runs[0]['notes_requests']} | {cell('notes_store_cpu_s')(runs)} | "
                     f"{cell('notes_read_s')(runs) if NOTES_SIGNED else '-'} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        write_result(args.out, args.name, {"benchmark": "report_cost", "commit": git_commit(),
                                           "form": "host" if HOST_FORM else "worker",
                                           "notes": "host" if NOTES_BY_HOST else "worker",
                                           "notes_signed": NOTES_SIGNED,
                                           "rows": rows, "machine": machine_description()},
                     text)


if __name__ == "__main__":
    main()
