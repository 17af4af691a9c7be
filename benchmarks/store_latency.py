"""The job's store (trainmover/core/kvstore.py) against torch's TCPStore, which it replaced:
round-trip latency of single requests from one client, and the commit vote's round with
voters in separate processes, each voter signing its values as a job's workers do.

    python benchmarks/store_latency.py [--repeats 3] [--voters 2,4] [--rounds 400]

Prints a markdown table; with --out, writes <out>.md and <out>.json (medians of the
repeats, with min and max; each repeat a fresh server, the two stores interleaved)."""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

RUN_KEY = b"r" * 32


def _server(kind: str):
    """(server object, client factory) of one kind, in this process."""
    import torch.distributed as dist

    if kind == "tcpstore":
        srv = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                            timeout=timedelta(seconds=30))
        port = srv.port
        return srv, port
    from trainmover.core import kvserver

    srv = kvserver.serve(RUN_KEY)
    return srv, srv.port


def _client(kind: str, port: int):
    import torch.distributed as dist

    if kind == "tcpstore":
        return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    from trainmover.comm import store as job_store

    return job_store.connect(f"127.0.0.1:{port}", RUN_KEY, timedelta(seconds=30))


def op_latency_us(kind: str, n: int = 3000) -> dict:
    srv, port = _server(kind)
    c = _client(kind, port)
    c.set("warm", "x")
    out = {}
    for name, fn in (("set", lambda i: c.set(f"k{i % 64}", "v" * 64)),
                     ("get", lambda i: c.get(f"k{i % 64}")),
                     ("add", lambda i: c.add("counter", 1)),
                     ("check", lambda i: c.check([f"k{i % 64}"]))):
        t0 = time.perf_counter()
        for i in range(n):
            fn(i)
        out[name] = (time.perf_counter() - t0) / n * 1e6
    if kind != "tcpstore":
        srv.close()
    return out


def _voter(kind: str, port: int, rank: int, voters: int, rounds: int, q) -> None:
    from trainmover.core.auth import AuthStore
    from trainmover.worker.liveness import CommitVote

    class Clients:      # what CommitVote takes: a source of this thread's signed client
        def __init__(self):
            self.signed = AuthStore(_client(kind, port), RUN_KEY)

        def get(self):
            return self.signed

    vote = CommitVote(Clients(), voters, epoch=0, voter=f"w{rank}")
    times = []
    for step in range(rounds):
        t0 = time.perf_counter()
        assert vote(step, {})
        times.append(time.perf_counter() - t0)
    q.put((rank, times))


def vote_round_us(kind: str, voters: int, rounds: int) -> float:
    """The median round of the slowest voter (rounds after the first 50)."""
    srv, port = _server(kind)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_voter, args=(kind, port, r, voters, rounds, q))
             for r in range(voters)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(30)
    if kind != "tcpstore":
        srv.close()
    return max(statistics.median(t[50:]) for t in got.values()) * 1e6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--voters", default="2,4")
    p.add_argument("--rounds", type=int, default=400)
    p.add_argument("--out", default=None, help="path prefix of the .md and .json results")
    a = p.parse_args()
    voters = [int(v) for v in a.voters.split(",")]
    rows: dict[str, dict[str, list[float]]] = {}
    for _ in range(a.repeats):
        for kind in ("tcpstore", "kvstore"):        # interleaved
            r = rows.setdefault(kind, {})
            for op, us in op_latency_us(kind).items():
                r.setdefault(op, []).append(us)
            for v in voters:
                r.setdefault(f"vote{v}", []).append(vote_round_us(kind, v, a.rounds))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=ROOT).stdout.strip()
    cols = ["set", "get", "add", "check"] + [f"vote{v}" for v in voters]
    lines = [f"# The job's store against TCPStore (commit {commit}, {a.repeats} repeats)", "",
             "Command: `python benchmarks/store_latency.py "
             f"--repeats {a.repeats} --voters {a.voters} --rounds {a.rounds}`", "",
             "Single requests: mean round trip of 3,000 in a row from one client. "
             "voteN: one commit-vote round with N voter processes, signed values "
             "(median round of the slowest voter). Microseconds; median (min-max) of the "
             "repeats.", "",
             "| store | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for kind, r in rows.items():
        cells = [f"{statistics.median(r[c]):.0f} ({min(r[c]):.0f}-{max(r[c]):.0f})"
                 for c in cols]
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out + ".md", "w") as f:
            f.write(text)
        import torch

        rows_out = [{"store": kind, "measure": col, "median_us": round(statistics.median(v), 1),
                     "min_us": round(min(v), 1), "max_us": round(max(v), 1)}
                    for kind, r in rows.items() for col, v in r.items()]
        with open(a.out + ".json", "w") as f:
            json.dump({"commit": commit, "command": ["python", "benchmarks/store_latency.py",
                                                     *sys.argv[1:]],
                       "machine": {"cores": os.cpu_count(), "torch": torch.__version__},
                       "repeats": a.repeats, "rounds": a.rounds, "rows": rows_out,
                       "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
