"""A client's read of one large value from the job's store (``core/kvstore.KVClient.get``):
a step's ballots at thousands of hosts (270 KB at 2,048, 1.7 MB at 12,500), a snapshot,
a host's reports. Runs the tree it sits in (copy it into a worktree for a before figure).

    python benchmarks/store_big_get.py [--sizes 65536,270000,1700000,8000000]
        [--gets 40] [--repeats 3] [--out DIR --name NAME]

Each repeat a fresh store in this process; per size the median of ``--gets`` reads; the
table gives the median (min-max) of the repeats' medians.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from trainmover.bench.report import fmt_spread, spread, write_script_result  # noqa: E402
from trainmover.core import kvserver, kvstore  # noqa: E402


def one_repeat(sizes: list[int], gets: int) -> dict[int, float]:
    key = os.urandom(32)
    srv = kvserver.serve(key)
    client = kvstore.connect("127.0.0.1", srv.port, key, 30)
    out = {}
    try:
        for size in sizes:
            client.set("big", b"x" * size)
            times = []
            for _ in range(gets):
                t = time.perf_counter()
                value = client.get("big")
                times.append(time.perf_counter() - t)
                if len(value) != size:
                    raise SystemExit(f"read {len(value)} bytes of {size}")
            out[size] = statistics.median(times) * 1e3
    finally:
        client.close()
        srv.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="65536,270000,1700000,8000000")
    ap.add_argument("--gets", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--name", default="store_big_get")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    reps = [one_repeat(sizes, args.gets) for _ in range(args.repeats)]
    rows = [{"bytes": s, "get_ms": spread([r[s] for r in reps])} for s in sizes]
    lines = ["| value (bytes) | one get (ms) |", "|---|---|"]
    lines += [f"| {r['bytes']:,} | {fmt_spread(r['get_ms'], 2)} |" for r in rows]
    table = "\n".join(lines)
    if not args.out:
        print(table)
        return
    write_script_result(args.out, args.name, "store_big_get", table, rows=rows)


if __name__ == "__main__":
    main()
