"""What a host's door to the store (``core/kvproxy.py``) costs and saves: one request's round
trip from a client straight to the store and through a door, the store's CPU per request
either way, and the connections the store holds for a host's processes.

    python benchmarks/door_cost.py --requests 5000 --clients 1,8 --repeats 3 [--out DIR]

The store runs in a process of its own (as host 0's agent serves it), the door in another
(as every host's agent holds one), the clients in this one: ``clients`` threads, each a
connection of its own (a host's processes and their threads), each doing ``requests``
``add``s one after the other (a vote's request). Per repeat, straight and through the door
alternate. Reported: the median and p99 of one request's round trip, the store's CPU per
request (from /proc), and the store's connections (from its /proc/<pid>/fd)."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.store_process import cpu_s, store_process  # noqa: E402
from trainmover.bench.report import (fmt_spread, git_commit, machine_description,  # noqa: E402
                                     spread, write_result)
from trainmover.core import kvstore  # noqa: E402

KEY = b"d" * 32
DOOR = """
import sys
from trainmover.core import kvproxy
d = kvproxy.serve(bytes.fromhex(sys.argv[1]), "127.0.0.1", int(sys.argv[2]), 10.0)
print(d.port, flush=True)
sys.stdin.read()
"""


def sockets(pid: int) -> int:
    """The process's open sockets (the store's: its listener, its wake pair, connections)."""
    fd_dir = f"/proc/{pid}/fd"
    n = 0
    for fd in os.listdir(fd_dir):
        try:
            n += os.readlink(os.path.join(fd_dir, fd)).startswith("socket:")
        except OSError:
            pass
    return n


def run(port: int, clients: int, requests: int, store_pid: int) -> dict:
    conns = [kvstore.connect("127.0.0.1", port, KEY, 30.0) for _ in range(clients)]
    times: list[list[float]] = [[] for _ in range(clients)]
    held = sockets(store_pid)
    barrier = threading.Barrier(clients)

    def work(i: int) -> None:
        c, out = conns[i], times[i]
        barrier.wait()
        for _ in range(requests):
            t = time.perf_counter()
            c.add(f"votes/{i}", 1)
            out.append(time.perf_counter() - t)

    before = cpu_s(store_pid)
    threads = [threading.Thread(target=work, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    store_cpu = cpu_s(store_pid) - before
    for c in conns:
        c.close()
    flat = sorted(x for ts in times for x in ts)
    return {"p50_us": flat[len(flat) // 2] * 1e6, "p99_us": flat[int(len(flat) * 0.99)] * 1e6,
            "store_cpu_us_per_request": store_cpu / len(flat) * 1e6,
            "store_sockets": held}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--clients", default="1,8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out")
    ap.add_argument("--name", default="door_cost")
    args = ap.parse_args()
    rows = []
    with store_process(KEY) as (server, port):
        door = subprocess.Popen([sys.executable, "-c", DOOR, KEY.hex(), str(port)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            door_port = int(door.stdout.readline())
            for n in [int(x) for x in args.clients.split(",")]:
                runs = {"straight": [], "door": []}
                for _ in range(args.repeats):
                    runs["straight"].append(run(port, n, args.requests, server.pid))
                    runs["door"].append(run(door_port, n, args.requests, server.pid))
                rows.append({"clients": n, "runs": runs})
        finally:
            door.kill()
            door.wait()

    def cell(runs, key, digits=0):
        return fmt_spread(spread([r[key] for r in runs]), digits)
    lines = ["# A host's door to the store: a request's cost straight and through it", "",
             f"`python benchmarks/door_cost.py --requests {args.requests} --clients "
             f"{args.clients} --repeats {args.repeats}`; commit {git_commit()}; "
             f"{machine_description()['cores']} cores; store, door and clients in three "
             f"processes. Median (min-max) over the repeats.", "",
             "| clients | path | round trip p50 (us) | p99 (us) | store CPU a request (us) | "
             "store's sockets while connected |", "|---|---|---|---|---|---|"]
    for row in rows:
        for path in ("straight", "door"):
            runs = row["runs"][path]
            lines.append(f"| {row['clients']} | {path} | {cell(runs, 'p50_us')} | "
                         f"{cell(runs, 'p99_us')} | {cell(runs, 'store_cpu_us_per_request', 1)} "
                         f"| {runs[0]['store_sockets']} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        write_result(args.out, args.name, {"benchmark": "door_cost", "commit": git_commit(),
                                           "rows": rows, "machine": machine_description()},
                     text)


if __name__ == "__main__":
    main()
