"""The straggler detector's input path against the number of workers (issue #24), in the code
of a source tree, at N workers on N/8 hosts. Run it once per tree (e.g. a `git worktree`
checkout of an older commit) to compare them.

    PYTHONPATH=TREE python benchmarks/straggler_feed.py [--sizes 1024,...] [--repeats 3]

What it drives: the tree's own ``control.stragglers.Stragglers`` (policy ``alert``) over the
tree's signed store client (``core.auth.AuthStore``) on an in-memory store that counts the
keys read and the bytes returned (no sockets: the round trips are not what is measured).
Every worker's window of measurements is written the way the tree's workers or agents write
it: one key a worker (``perf/<worker>``, older trees) or one a host (``agent/<n>/perf``,
announced by the host's beat). Then, per repeat, one window comes in for every worker and
the supervision round calls ``poll`` until the window's verdicts are in, while a probe
stands in for the rest of the round (1 ms of Python work and 1 ms asleep, as a round's
store round trips).

Columns:
- ``keys read / window``, ``MB read / window``: what the straggler path read at the store
  for one window of every worker, counted;
- ``keys read / s``: that, at the rate the tree reads: older trees read every worker's key
  every ``check_interval_s`` (0.5 s) whatever changed (counted over one poll, times 2); the
  newer one reads the hosts that announced a window, once a window (a window of 8 steps of
  1 s: the count per window / 8; stated, not timed);
- ``poll in round (ms)``: the longest single ``poll`` call of the round while the window
  was taken in (older trees: the whole reading and judging; newer: handing hosts over and
  acting on verdicts; the reading and judging run on the feed's thread);
- ``probe round (ms)``: the longest probe round meanwhile (2 ms alone): what the feed's
  thread costs the round through the interpreter lock;
- ``window done (ms)``: from the window's arrival to its verdicts acted on.
Each cell: median (min-max) over the repeats.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import time
from types import SimpleNamespace

import trainmover
from trainmover.control.stragglers import Stragglers
from trainmover.core import protocol as P
from trainmover.core.auth import AuthStore
from trainmover.core.config import StragglerConfig
from trainmover.core.topology import Role

PER_HOST = 8
HOST_FORM = "HostPerf" in P.__dict__
try:      # trees whose controller freezes its start-up state (control/collector.py)
    from trainmover.control import collector
except ImportError:
    collector = None
STEP_S = 1.0          # the step time the per-second column assumes


class MemStore:
    """A store's methods that the straggler path calls, in memory, counting reads."""

    def __init__(self):
        self.data: dict[str, bytes] = {}
        self.keys_read = self.bytes_read = 0

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        self.keys_read += 1
        self.bytes_read += len(self.data[key])
        return self.data[key]

    def check(self, keys):
        return all(k in self.data for k in keys)

    def try_get(self, key):
        return self.try_multi_get([key])[0]

    def try_multi_get(self, keys):
        out = [self.data.get(k) for k in keys]
        self.keys_read += len(keys)
        self.bytes_read += sum(len(v) for v in out if v is not None)
        return out


def perf(role: str, last: int, compute_s: float, window: int) -> P.StepPerf:
    recent = [P.PerfWindow(last - window * (k + 1) + 1, last - window * k, compute_s)
              for k in reversed(range(min(P.PERF_HISTORY, last // window + 1)))]
    return P.StepPerf(role, last - window + 1, last, 0, compute_s, compute_s,
                      {"dp": 0.001, "vote": 0.0002}, 1.0, 0.0, recent)


class Job:
    def __init__(self, workers: int):
        self.n, self.hosts = workers, workers // PER_HOST
        self.raw = MemStore()
        key = b"k" * 32
        self.store = AuthStore(self.raw, key)
        # roles: 8 pipeline stages x tensor 1, data-parallel across the rest
        roles = {f"w{i}": Role(i // 8, i % 8, 0) for i in range(workers)}
        self.roles = roles
        self.events: list = []
        cfg = SimpleNamespace(straggler=StragglerConfig(policy="alert"), train=None)
        self.ctx = SimpleNamespace(
            cfg=cfg, store=self.store, committed=0,
            membership=SimpleNamespace(workers=roles, standbys={}),
            events=SimpleNamespace(emit=lambda e, **kw: self.events.append(e)),
            progress=SimpleNamespace(say=lambda text: None))
        self.moved: set[int] = set()
        self.window = cfg.straggler.window
        params = inspect.signature(Stragglers).parameters
        if "health" in params:
            health = SimpleNamespace(read_hosts=lambda now: None, perf_moved=self._moved)
            self.stragglers = Stragglers(self.ctx, None, health,
                                         lambda: AuthStore(self.raw, key))
        else:
            self.stragglers = Stragglers(self.ctx, None)
        self.k = 0

    def _moved(self) -> set[int]:
        moved, self.moved = self.moved, set()
        return moved

    def write_window(self) -> None:
        """Every worker's next window, as the tree's workers or agents write it."""
        last = self.window * (self.k + 1) - 1
        self.k += 1
        noise = [0.1 * (1 + 0.01 * ((i * 7919 + self.k) % 5)) for i in range(self.n)]
        if HOST_FORM:
            for node in range(self.hosts):
                names = [f"w{i}" for i in range(node * PER_HOST, (node + 1) * PER_HOST)]
                self.store.set(P.agent_key(node, "perf"), P.write_message(P.HostPerf(
                    self.k, {w: perf(self.roles[w].name, last, noise[int(w[1:])],
                                     self.window) for w in names})))
                self.moved.add(node)
        else:
            for i in range(self.n):
                w = f"w{i}"
                self.store.set(P.perf_key(w), P.write_message(
                    perf(self.roles[w].name, last, noise[i], self.window)))
        self.last = last

    def done(self) -> bool:
        latest = self.stragglers.latest
        # a dict where the tree keeps the status's form (status_perf), else the message
        return len(latest) == self.n and all(
            (p["last_step"] if isinstance(p, dict) else p.last_step) == self.last
            for p in latest.values())


def probe() -> float:
    """A stand-in for the rest of a supervision round: 1 ms of work, 1 ms asleep."""
    t0 = time.perf_counter()
    end = time.thread_time() + 0.001
    while time.thread_time() < end:
        pass
    time.sleep(0.001)
    return time.perf_counter() - t0


def measure(workers: int, repeats: int) -> dict:
    out = {k: [] for k in ("keys", "mb", "keys_per_s", "poll_ms", "probe_ms", "done_ms")}
    for _ in range(repeats):
        job = Job(workers)
        if collector is not None:         # as the tree's controller does once it started
            collector.settle()
        for _ in range(3):                # settled: the detector has its tracks
            job.write_window()
            job.stragglers._read_at = 0.0
            deadline = time.monotonic() + 600
            while not job.done():
                job.stragglers.poll()
                time.sleep(0.002)
                assert time.monotonic() < deadline
        alone = min(probe() for _ in range(20))
        job.write_window()
        job.raw.keys_read = job.raw.bytes_read = 0
        job.stragglers._read_at = 0.0
        t0 = time.perf_counter()
        polls, probes = [], []
        while not job.done():
            tp = time.perf_counter()
            job.stragglers.poll()
            polls.append(time.perf_counter() - tp)
            probes.append(probe())
        done = time.perf_counter() - t0
        keys = job.raw.keys_read
        out["keys"].append(keys)
        out["mb"].append(job.raw.bytes_read / 1e6)
        out["keys_per_s"].append(keys / (job.window * STEP_S) if HOST_FORM else
                                 keys / job.ctx.cfg.straggler.check_interval_s)
        out["poll_ms"].append(max(polls) * 1000)
        out["probe_ms"].append(max(probes) * 1000)
        out["done_ms"].append(done * 1000)
        out.setdefault("probe_alone_ms", []).append(alone * 1000)
        if collector is not None:
            collector.release()
    return out


def cell(values: list[float], digits: int = 1) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-" \
           f"{max(values):.{digits}f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1024,4096,16384")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=os.path.dirname(trainmover.__file__)).stdout.strip()
    form = "host" if HOST_FORM else "worker"
    rows = []
    print(f"commit {commit}, measurements by {form}")
    print("| workers (hosts) | keys read / window | MB read / window | keys read / s | "
          "poll in round (ms) | probe round (ms) | window done (ms) |\n"
          "|---|---|---|---|---|---|---|")
    for n in (int(s) for s in args.sizes.split(",")):
        got = measure(n, args.repeats)
        rows.append({"workers": n, "hosts": n // PER_HOST, **got})
        print(f"| {n} ({n // PER_HOST}) | {cell(got['keys'], 0)} | {cell(got['mb'], 2)} | "
              f"{cell(got['keys_per_s'], 0)} | {cell(got['poll_ms'])} | "
              f"{cell(got['probe_ms'])} | {cell(got['done_ms'])} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"commit": commit, "form": form, "step_s": STEP_S, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
