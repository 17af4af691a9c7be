"""A job over several hosts on one machine (network namespaces, ``netns.py``), shared by the
multi-host tests and ``trainmover bench hosts``: cross-host vs same-host planned migration,
measured in the same run."""
from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time

from trainmover.bench.netns import Hosts
from trainmover.bench.report import git_commit, machine_description, write_result
from trainmover.core.config import JobConfig
from trainmover.core.events import read_jsonl
from trainmover.core.topology import Layout
from trainmover.recipes import get_recipe


def job_config(store_host: str | None = None, nnodes: int = 1, steps: int = 120,
               **settings) -> JobConfig:
    """DP2 x PP2, two workers per host on hosts 0 and 1, three standbys (one per host of
    three): host 2 is a spare."""
    cfg = get_recipe("tiny")
    cfg.layout = Layout(2, 2, 1)
    cfg.train.steps = steps
    cfg.train.threads_per_worker = 1
    cfg.override(standby_count=3, health_heartbeat_timeout_s=2.0,
                 recovery_report_timeout_s=4.0)
    if nnodes > 1:
        cfg.override(process_store_host=store_host, process_allow_remote=True,
                     hosts_nnodes=nnodes,
                     hosts_nproc_per_node=2)
    return cfg.override(**settings).validate()


def wait_for(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


class Cluster:
    """A job over ``hosts``: the controller (in this process) and host 0's agent in the root
    namespace, `trainmover agent` in each other namespace, as a cluster's launcher runs it."""

    def __init__(self, hosts: Hosts, run_dir: str, **settings):
        from trainmover.api import Job

        self.hosts, self.run_dir = hosts, run_dir
        self.cfg = job_config(hosts.addresses[0], len(hosts.addresses), **settings)
        self.job = Job(self.cfg, run_dir, timeout_s=600)
        self.agents: list[subprocess.Popen] = []

    def __enter__(self) -> "Cluster":
        self.job.start()   # host 0's processes start; the others' wait in the store
        with open(os.path.join(self.run_dir, "control.json")) as f:
            endpoint = json.load(f)["store"]
        for i in range(1, len(self.hosts.addresses)):
            with open(os.path.join(self.run_dir, f"agent-host{i}.out"), "wb") as log:
                self.agents.append(self.hosts.run(i, [
                    sys.executable, "-m", "trainmover", "agent", "--run-dir", self.run_dir,
                    "--rdzv-endpoint", endpoint, "--node-rank", str(i),
                    "--nnodes", str(len(self.hosts.addresses)),
                    "--address", self.hosts.addresses[i]],
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        return self

    def __exit__(self, *exc) -> None:
        self.job.coordinator.stop()
        for a in self.agents:
            try:
                a.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(a.pid, signal.SIGKILL)
                a.wait()

    def events(self, name: str | None = None) -> list[dict]:
        out = read_jsonl(os.path.join(self.run_dir, "events.jsonl"))
        return [e for e in out if name is None or e["event"] == name]

    def steps(self) -> int:
        return self.job.coordinator.progress.last_step + 1

    def all_warm(self) -> bool:
        return all(st.value == "warm"
                   for st in self.job.coordinator.membership.standbys.values())

    def host_of(self, name: str) -> int:
        return self.job.coordinator.ctx.hosts[name]


def bench_hosts(repeats: int = 3, out_dir: str = "benchmarks/results") -> dict:
    """Per repeat, one job over three hosts: a planned migration inside host 0 (w1 -> s0),
    then one from host 1 to host 2 (w2 -> s2); downtime of each, and their ratio."""
    import tempfile

    runs = []
    for r in range(repeats):
        with tempfile.TemporaryDirectory(prefix="tm-bench-hosts-") as scratch, \
                Hosts(3) as hosts, Cluster(hosts, os.path.join(scratch, "run"),
                                           steps=100_000) as c:
            wait_for(lambda: c.steps() >= 5 and c.all_warm(), 300, "warm standbys")
            same = c.job.migrate(["w1"], ["s0"], timeout_s=300)
            wait_for(lambda: c.steps() >= same["switch_step"] + 8, 300, "steps after")
            cross = c.job.migrate(["w2"], ["s2"], timeout_s=300)
            wait_for(lambda: c.steps() >= cross["switch_step"] + 8, 300, "steps after")
            c.job.coordinator.stop()
            summary = c.job.wait(300)
        done = {m["pairs"][0]["leaver"]: m for m in summary["migrations"]
                if m["status"] == "done"}
        runs.append({"same_host": done["w1"]["downtime_s"], "cross_host": done["w2"]["downtime_s"],
                     "same_phases": done["w1"]["phases"], "cross_phases": done["w2"]["phases"],
                     "transfer_bytes": done["w2"]["transfer_bytes"]})
        print(f"repeat {r + 1}/{repeats}: same host {runs[-1]['same_host'] * 1000:.1f} ms, "
              f"cross host {runs[-1]['cross_host'] * 1000:.1f} ms", flush=True)
    result = {"repeats": runs, "commit": git_commit(), "machine": machine_description()}
    write_result(out_dir, "hosts", result, _hosts_table(result))
    return result


def _stats(xs: list[float]) -> str:
    return (f"{statistics.median(xs) * 1000:.1f} ms (min {min(xs) * 1000:.1f}, "
            f"max {max(xs) * 1000:.1f})")


def _hosts_table(r: dict) -> str:
    same = [x["same_host"] for x in r["repeats"]]
    cross = [x["cross_host"] for x in r["repeats"]]
    ratios = [c / s for c, s in zip(cross, same)]
    spread = max(same + cross) - min(same + cross)
    verdict = ("no measurable difference" if min(ratios) <= 1.0 <= max(ratios) else
               f"ratio {statistics.median(ratios):.2f}")
    return "\n".join([
        f"# bench hosts: planned migration inside a host vs across hosts (commit {r['commit']})",
        "",
        "Three hosts as network namespaces on one machine (veth pairs on a bridge), DP2 x PP2, "
        "tiny recipe, one thread per worker. Each repeat is one job: w1 -> s0 (both on host "
        "0), then w2 (host 1) -> s2 (host 2), always in that order; downtime as the job "
        "reports it (the commit gap at the switch step minus the median of the 5 gaps "
        "before, from the reporting worker's metrics; clamped at 0). w1 holds the last "
        "pipeline stage, w2 the first. The order is fixed, so an order effect is not "
        "excluded.",
        "",
        "| migration | downtime, median of repeats |",
        "|---|---|",
        f"| same host | {_stats(same)} |",
        f"| cross host | {_stats(cross)} |",
        "",
        f"cross / same per repeat: {', '.join(f'{x:.2f}' for x in ratios)} -> {verdict} "
        f"(target <= 1.5x); spread of all downtimes {spread * 1000:.1f} ms",
        f"{len(r['repeats'])} repeats; machine: {r['machine']['cpu']}, "
        f"{r['machine']['cores']} cores, torch {r['machine']['torch']}", ""])
