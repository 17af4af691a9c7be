"""The controller's failure detector against the number of workers (issue #24): what one
supervision round costs it (process exits) and what one look costs it (every host's beat
read and judged), in the code of a source tree, at N workers on N/8 hosts. Run it once per
tree (e.g. `git worktree` checkouts of two commits) to compare them.

    PYTHONPATH=TREE python benchmarks/health_scale.py [--sizes 1024,...] [--repeats 5]

What it drives: the tree's own ``control.health.Health`` and ``control.processes.AgentClient``
over the tree's signed store client (``core.auth.AuthStore``) on an in-memory store (no
sockets: the round trips are not what is measured). Every host's agent writes its beat the
way the tree's agent does (``P.HostBeat``: each process's count of beats in the old form, the
quiet processes in the new), all processes beating; between two looks a fifth of the hosts
write a new beat (a look every 50 ms, a beat every 250 ms, as the defaults). A "round" is a
``detect`` between looks; a "look" a ``detect`` and a ``hung_standbys`` with a look due.
Each cell: median (min-max) over REPEATS runs of the mean of 20 rounds or looks, in ms.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from types import SimpleNamespace

import trainmover
from trainmover.control import health as H
from trainmover.control.processes import AgentClient, ProcView
from trainmover.core import protocol as P
from trainmover.core.auth import AuthStore
from trainmover.core.config import HealthConfig

NEW_FORM = "quiet" in P.HostBeat.__dataclass_fields__
PER_HOST = 8


class MemStore:
    """A store's methods that the detector calls, in memory."""

    def __init__(self):
        self.data: dict[str, bytes] = {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.data[key]

    def try_get(self, key):
        return self.data.get(key)

    def try_multi_get(self, keys):
        return [self.data.get(k) for k in keys]

    def check(self, keys):
        return all(k in self.data for k in keys)

    def add(self, key, amount):
        value = int(self.data.get(key, b"0")) + amount
        self.data[key] = str(value).encode()
        return value


class Clock:
    def __init__(self):
        self.now = 1000.0

    def time(self):
        return self.now

    def monotonic(self):
        return self.now


def build(workers: int):
    hosts = workers // PER_HOST
    store = AuthStore(MemStore(), b"k" * 32)
    names = [f"w{i}" for i in range(workers)]
    procs = AgentClient(store=store, nnodes=hosts)
    for i, name in enumerate(names):
        procs.procs[name] = ProcView(False, 1, i // PER_HOST, pid=10_000 + i)
    health_cfg = HealthConfig()
    ctx = SimpleNamespace(
        cfg=SimpleNamespace(health=health_cfg, process=SimpleNamespace(etcd="")),
        store=store, procs=procs, epoch=0, steady_since=0.0,
        membership=SimpleNamespace(workers=dict.fromkeys(names), standbys={}),
        progress=SimpleNamespace(records=[], say=lambda text: None),
        events=SimpleNamespace(emit=lambda *a, **k: None))
    seqs = [0] * hosts

    def beat(node: int) -> None:
        seqs[node] += 1
        first = node * PER_HOST
        if NEW_FORM:
            msg = P.HostBeat(seqs[node], 5_000 + node, PER_HOST, {})
        else:
            msg = P.HostBeat(seqs[node], 5_000 + node, {
                f"w{i}": [10_000 + i, seqs[node]] for i in range(first, first + PER_HOST)})
        store.set(P.agent_key(node, "hb"), P.write_message(msg))

    return ctx, hosts, beat


def measure(workers: int, repeats: int, times: int = 20) -> dict:
    clock = Clock()
    H.time = clock               # the detector's clock: looks due when this says
    out = {"round_ms": [], "look_ms": []}
    for _ in range(repeats):
        ctx, hosts, beat = build(workers)
        for node in range(hosts):
            beat(node)
        health = H.Health(ctx)
        health.detect(set())                       # first look: every beat decoded
        health.hung_standbys()
        part = 0
        rounds = looks = 0.0
        for _ in range(times):
            clock.now += 0.01                      # a round between looks
            t0 = time.perf_counter()
            assert health.detect(set()) == []
            rounds += time.perf_counter() - t0
            clock.now += ctx.cfg.health.check_interval_s
            for node in range(part, hosts, 5):     # a fifth of the hosts beat again
                beat(node)
            part = (part + 1) % 5
            t0 = time.perf_counter()
            assert health.detect(set()) == []
            health.hung_standbys()
            looks += time.perf_counter() - t0
        out["round_ms"].append(rounds / times * 1000)
        out["look_ms"].append(looks / times * 1000)
    return out


def cell(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1024,4096,16384,65536,131072")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=os.path.dirname(trainmover.__file__)).stdout.strip()
    rows = []
    print(f"commit {commit}, HostBeat form: {'quiet' if NEW_FORM else 'counts'}")
    print("| workers (hosts) | round (ms) | look (ms) |\n|---|---|---|")
    for n in (int(s) for s in args.sizes.split(",")):
        got = measure(n, args.repeats)
        rows.append({"workers": n, "hosts": n // PER_HOST, **got})
        print(f"| {n} ({n // PER_HOST}) | {cell(got['round_ms'])} | {cell(got['look_ms'])} |",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"commit": commit, "form": "quiet" if NEW_FORM else "counts",
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
