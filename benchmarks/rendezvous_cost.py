"""What one communicator's rendezvous costs the job's store, as each backend of torch 2.13
does it through the store (issue #24: "a group rebuild's rendezvous moves n(n-1) keys"):

- gloo (``ProcessGroupGloo``, a full mesh): each of the n members sets one key holding an
  address for every peer (154 + 8n bytes, measured with a counting store on torch 2.13),
  then reads every member's: n sets and n reads of n keys, O(n^2) bytes;
- NCCL (``ProcessGroupNCCL``): rank 0 sets the communicator's unique id (128 bytes) and the
  other n-1 read it: O(n) requests of constant size (NCCL then bootstraps over its own
  sockets, outside the store: not measured here).

    python benchmarks/rendezvous_cost.py --sizes 64,256,1024 --repeats 3 [--out DIR]

The store (``core/kvserver.py``, one thread, as a job's) runs in a process of its own; the
requests come from 8 client connections in turn (the members' reads wait for every set,
as they do in a job, by coming after them). Measured: the store process's CPU (from
/proc) and the wall time of the whole rendezvous seen from this process, which also pays
the clients' side. A data-parallel group has n = DP members: 64 at 4K workers and 256 at
16K in ``bench control``'s layout (PP8 x TP8), 1,563 at 100K."""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.store_process import cpu_s, store_process  # noqa: E402
from trainmover.bench.report import git_commit, machine_description, write_result  # noqa: E402
from trainmover.core import kvstore  # noqa: E402

KEY = b"z" * 32
CLIENTS = 8
NCCL_ID_BYTES = 128


def gloo_rendezvous(stores, prefix: str, n: int) -> int:
    keys = [f"{prefix}/0/{rank}" for rank in range(n)]
    value = b"a" * (154 + 8 * n)
    for rank, key in enumerate(keys):
        stores[rank % CLIENTS].set(key, value)
    moved = 0
    for rank in range(n):
        moved += sum(len(v) for v in stores[rank % CLIENTS].multi_get(keys))
    return moved + n * len(value)


def nccl_rendezvous(stores, prefix: str, n: int) -> int:
    key = f"{prefix}/0"
    stores[0].set(key, b"i" * NCCL_ID_BYTES)
    moved = NCCL_ID_BYTES
    for rank in range(1, n):
        moved += len(stores[rank % CLIENTS].get(key))
    return moved


def measure(server, stores, backend: str, n: int, generation: int) -> dict:
    prefix = f"groups/dp/gen{generation}"
    before, t0 = cpu_s(server.pid), time.perf_counter()
    moved = (gloo_rendezvous if backend == "gloo" else nccl_rendezvous)(stores, prefix, n)
    wall = time.perf_counter() - t0
    store_cpu = cpu_s(server.pid) - before
    # the controller's retention deletes a replaced generation's keys (not measured)
    for rank in range(n if backend == "gloo" else 1):
        stores[0].delete_key(f"{prefix}/0/{rank}" if backend == "gloo" else f"{prefix}/0")
    return {"store_cpu_s": store_cpu, "wall_s": wall, "bytes": moved,
            "requests": 2 * n if backend == "gloo" else n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="64,256,1024")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", help="write NAME.md/.json here")
    ap.add_argument("--name", default="rendezvous_cost")
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    if any(n < 2 for n in sizes) or args.repeats < 1:
        raise SystemExit(f"--sizes {args.sizes} --repeats {args.repeats}: sizes of at least 2 "
                         f"members, at least one repeat")
    rows, generation = [], 0
    with store_process(KEY) as (server, port):
        stores = [kvstore.connect("127.0.0.1", port, KEY, 600.0) for _ in range(CLIENTS)]
        for n in sizes:
            for backend in ("gloo", "nccl"):
                runs = []
                for _ in range(args.repeats):
                    generation += 1
                    runs.append(measure(server, stores, backend, n, generation))
                rows.append({"members": n, "backend": backend, "runs": runs})
                print(f"{n} {backend}: store CPU "
                      f"{statistics.median(r['store_cpu_s'] for r in runs):.3f} s", flush=True)

    def cell(runs, key, digits=3):
        values = [r[key] for r in runs]
        return (f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-"
                f"{max(values):.{digits}f})")
    lines = ["# One communicator's rendezvous through the job's store: gloo's full mesh "
             "against NCCL's unique id", "",
             f"`python benchmarks/rendezvous_cost.py --sizes {args.sizes} --repeats "
             f"{args.repeats}`; commit {git_commit()}; {machine_description()['cores']} cores. "
             f"Median (min-max) over the repeats (the module doc says what is measured).", "",
             "| members | backend | requests | bytes through the store (MB) | store CPU (s) | "
             "wall (s) |", "|---|---|---|---|---|---|"]
    for row in rows:
        runs = row["runs"]
        lines.append(f"| {row['members']} | {row['backend']} | {runs[0]['requests']} | "
                     f"{runs[0]['bytes'] / 1e6:.3f} | {cell(runs, 'store_cpu_s')} | "
                     f"{cell(runs, 'wall_s')} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        write_result(args.out, args.name, {"benchmark": "rendezvous_cost",
                                           "commit": git_commit(), "rows": rows,
                                           "machine": machine_description()}, text)


if __name__ == "__main__":
    main()
