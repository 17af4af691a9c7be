"""What one abort costs the job's store to hand out: from the controller's write of
``abort/<epoch>`` to the last of its waiters' answers, with one waiter a worker (each
worker's own watch, before ``agent/aborts.py``) or one a host (each agent's, after).

    python benchmarks/abort_fanout.py --waiters 8,2048,16384 --repeats 5 [--out DIR]

The store (``core/kvserver.py``, one thread, as a job's) runs in a process of its own; this
process opens ``N`` authenticated connections, sends a wait for the key on each (the
request a watcher blocks in), waits until the server holds them all, then writes the key
from another connection and times, with ``epoll``, until every waiting connection has its
answer to read. The waiters' side only counts readable sockets (about a microsecond
each), so the figure is the store's: its answers one after another. 16,384 waiters is a
16K-worker job's per-worker watch, 2,048 its hosts'. Prints milliseconds per abort."""
from __future__ import annotations

import argparse
import os
import select
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trainmover.bench.report import git_commit, machine_description, write_result  # noqa: E402
from trainmover.core import kvstore  # noqa: E402
from trainmover.core.proc import raise_open_files  # noqa: E402

KEY = b"f" * 32
SERVER = """
import sys, time
from trainmover.core import kvserver
from trainmover.core.proc import raise_open_files
raise_open_files(1 << 20)
s = kvserver.serve(bytes.fromhex(sys.argv[1]))
print(s.port, flush=True)
sys.stdin.read()
"""


def one(port: int, waiters: int, epoch: int) -> float:
    """Seconds from the abort's write to the last waiter's answer readable."""
    key = f"abort/{epoch}"
    clients = [kvstore.connect("127.0.0.1", port, KEY, 60) for _ in range(waiters)]
    request = kvstore.encode_request(kvstore.Op.WAIT, [key.encode()], 0, 600_000)
    for c in clients:
        c._sock.sendall(request)
    writer = kvstore.connect("127.0.0.1", port, KEY, 60)
    # the server reads requests in arrival order per connection: a ping from every
    # waiting connection is not possible (they are blocked), so wait until the server has
    # had time to read them all (it answers the writer's ping after what it read before)
    time.sleep(0.5 + waiters / 20000)
    writer.ping()
    ep = select.epoll()
    for c in clients:
        ep.register(c._sock.fileno(), select.EPOLLIN)
    left = waiters
    t0 = time.perf_counter()
    writer.set(key, b"w3 failed")
    while left > 0:
        ready = ep.poll(10)
        if not ready:
            raise RuntimeError(f"{left} of {waiters} waiters had no answer within 10 s")
        for fd, _ in ready:
            ep.unregister(fd)          # answered: counted once
        left -= len(ready)
    took = time.perf_counter() - t0
    ep.close()
    for c in clients:
        c.close()
    writer.close()
    return took


def _machine(result: dict) -> str:
    m = result["machine"]
    return f"{m['cpu']}, {m['cores']} cores, Python {m['python']}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--waiters", default="8,2048,16384")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--name", default="abort_fanout")
    args = ap.parse_args()
    sizes = [int(x) for x in args.waiters.split(",")]
    if args.repeats < 3 or any(n < 1 for n in sizes):
        raise SystemExit(f"--repeats {args.repeats} (at least 3), --waiters {args.waiters}")
    raise_open_files(1 << 20)
    server = subprocess.Popen([sys.executable, "-c", SERVER, KEY.hex()], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=os.path.dirname(
                                  os.path.dirname(os.path.abspath(__file__)))))
    try:
        port = int(server.stdout.readline())
        rows, epoch = [], 0
        for n in sizes:
            times = []
            for _ in range(args.repeats):
                epoch += 1
                times.append(one(port, n, epoch) * 1e3)
            rows.append({"waiters": n, "ms": {"median": statistics.median(times),
                                              "min": min(times), "max": max(times)},
                         "us_per_waiter": statistics.median(times) * 1e3 / n})
            r = rows[-1]
            print(f"{n} waiters: {r['ms']['median']:.2f} ms ({r['ms']['min']:.2f}-"
                  f"{r['ms']['max']:.2f}), {r['us_per_waiter']:.1f} us a waiter", flush=True)
    finally:
        server.stdin.close()
        server.wait(10)
    if args.out:
        cmd = " ".join(["python benchmarks/abort_fanout.py"] + sys.argv[1:])
        result = {"benchmark": "abort_fanout", "rows": rows, "repeats": args.repeats,
                  "command": cmd, "commit": git_commit(), "machine": machine_description()}
        lines = [f"# One abort handed out by the store ({args.repeats} repeats, median "
                 f"(min-max) ms from the write to the last waiter's answer)", "",
                 f"command: `{cmd}`; commit {result['commit']}; {_machine(result)}", "",
                 "| waiters | ms | us a waiter |", "|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['waiters']} | {r['ms']['median']:.2f} ({r['ms']['min']:.2f}-"
                         f"{r['ms']['max']:.2f}) | {r['us_per_waiter']:.1f} |")
        write_result(args.out, args.name, result, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
