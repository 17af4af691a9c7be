"""A step's ballots and vote count written by H hosts at once, on the store on etcd and on
the built-in store: the store requests every host's agent makes for a step's vote
(``agent/votes.VoteRelay``: an append of its ballot line, an add of its voters to the
step's counter), from H threads each with a client of its own, released together.

On etcd both are revision-guarded transactions on one key (``core/etcdstore._update``):
of H writers racing, one wins each round and the others read the key again and retry, so
a step's vote costs H rounds and O(H^2) transactions (and each append's marker holds the
whole value). A third column has each host write keys of its own: the same requests
without the race.

    python benchmarks/etcd_vote.py [--hosts 8,32,64,128] [--rounds 3] [--repeats 3]
        [--out DIR --name NAME]

Each repeat a fresh three-member etcd cluster (``bench/etcd_cluster.py``, on this
machine's cores with the clients) and a fresh built-in store; per size the median of the
rounds' times from the release to the last host's add answered; the table gives the
median (min-max) of the repeats' medians. Needs Debian's etcd-server and openssl.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from trainmover.bench.report import fmt_spread, spread, write_script_result  # noqa: E402
from trainmover.core import kvserver, storeaddr  # noqa: E402


def _round(clients: list, tag: str, own: bool = False) -> float:
    """One step's writes; ``own``: each host to keys of its own (no race: what the same
    requests cost etcd without contention)."""
    release = threading.Barrier(len(clients) + 1)
    done: list[float] = []

    def host(i: int, client) -> None:
        key = f"{tag}/{i}" if own else tag
        release.wait()
        client.append(f"{key}/ballots", b"\n" + b"x" * 130 + b"\n")
        client.add(f"{key}/votes", 8)
        done.append(time.perf_counter())

    threads = [threading.Thread(target=host, args=(i, c), daemon=True)
               for i, c in enumerate(clients)]
    for t in threads:
        t.start()
    release.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    if not own and clients[0].add(f"{tag}/votes", 0) != 8 * len(clients):
        raise SystemExit(f"{tag}: the count is not every host's")
    return (time.perf_counter() - start) * 1e3


def one_repeat(store: str, sizes: list[int], rounds: int) -> dict[int, dict[str, float]]:
    run_key = os.urandom(32)
    with tempfile.TemporaryDirectory() as tmp:
        if store == "etcd":
            from trainmover.bench.etcd_cluster import EtcdCluster

            cluster = EtcdCluster(Path(tmp)).start()
            address, stop = cluster.address(), cluster.stop
        else:
            srv = kvserver.serve(run_key)
            address, stop = f"127.0.0.1:{srv.port}", srv.close
        try:
            out = {}
            for n in sizes:
                clients = [storeaddr.connect(address, run_key, 120) for _ in range(n)]
                out[n] = {"shared": statistics.median(_round(clients, f"{n}/{r}")
                                                      for r in range(rounds))}
                if store == "etcd":
                    out[n]["own"] = statistics.median(_round(clients, f"own/{n}/{r}", True)
                                                      for r in range(rounds))
                for c in clients:
                    c.close()
            return out
        finally:
            stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", default="8,32,64,128")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--name", default="etcd_vote")
    args = ap.parse_args()
    sizes = [int(h) for h in args.hosts.split(",")]
    reps = {s: [] for s in ("builtin", "etcd")}
    for _ in range(args.repeats):
        for store in reps:
            reps[store].append(one_repeat(store, sizes, args.rounds))
    rows = []
    for n in sizes:
        row = {"hosts": n}
        for name, store, kind in (("builtin_ms", "builtin", "shared"),
                                  ("etcd_ms", "etcd", "shared"),
                                  ("etcd_own_keys_ms", "etcd", "own")):
            vals = [r[n][kind] for r in reps[store]]
            row[name] = spread(vals)
        rows.append(row)
    lines = ["| hosts | built-in store (ms) | etcd (ms) | etcd, each host its own keys (ms) |",
             "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['hosts']} | " + " | ".join(
            fmt_spread(r[k], 0) for k in ("builtin_ms", "etcd_ms", "etcd_own_keys_ms")) + " |")
    table = "\n".join(lines)
    if not args.out:
        print(table)
        return
    write_script_result(args.out, args.name, "etcd_vote", table, rows=rows)


if __name__ == "__main__":
    main()
