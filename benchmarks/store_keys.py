"""The store's key count and the agent's and controller's memory over a long job: flat, or
growing with the steps? (Issue: weeks-long jobs.)

    python benchmarks/store_keys.py --steps 10000 --every 1000

Tiny recipe, DP2 x PP2, 2 standbys, one thread per worker; the key count is read from the
job's store (``num_keys``), the agent's resident memory from /proc. Writes
benchmarks/results/store_keys.{md,json}."""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trainmover.api import Job  # noqa: E402
from trainmover.bench.report import git_commit, machine_description, write_result  # noqa: E402
from trainmover.core.topology import Layout  # noqa: E402
from trainmover.recipes import get_recipe  # noqa: E402


def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10000)
    p.add_argument("--every", type=int, default=1000)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    cfg = get_recipe("tiny")
    cfg.layout = Layout(2, 2, 1)
    cfg.train.steps = args.steps
    cfg.train.threads_per_worker = 1
    cfg.override(standby_count=2)
    run_dir = os.path.join(tempfile.mkdtemp(prefix="tm-store-keys-"), "run")
    job = Job(cfg.validate(), run_dir, timeout_s=24 * 3600).start()
    coord = job.coordinator
    with open(os.path.join(run_dir, "control.json")) as f:
        agent = json.load(f)["agent_pid"]
    samples, nxt = [], args.every
    while nxt <= args.steps - 1 and job.running():
        if coord.progress.last_step + 1 >= nxt:
            samples.append({"step": coord.progress.last_step + 1,
                            "keys": coord.ctx.store.raw.num_keys(),
                            "agent_rss_mb": rss_mb(agent), "controller_rss_mb": rss_mb(os.getpid()),
                            "time": time.time()})
            print(json.dumps(samples[-1]), flush=True)
            nxt += args.every
        time.sleep(0.05)
    summary = job.wait(3600)
    result = {"samples": samples, "steps": summary["steps"], "commit": git_commit(),
              "machine": machine_description(),
              "gc_every_steps": cfg.controller.gc_every_steps}
    first, last = samples[0], samples[-1]
    lines = [f"# Store keys and control-plane memory over {summary['steps']} steps "
             f"(commit {result['commit']})", "",
             "Tiny recipe, DP2 x PP2, 2 standbys, `controller.gc_every_steps` "
             f"{cfg.controller.gc_every_steps}; one job, sampled every {args.every} steps.", "",
             "| step | store keys | agent RSS (MiB) | controller process RSS (MiB) |",
             "|---|---|---|---|"]
    lines += [f"| {s['step']} | {s['keys']} | {s['agent_rss_mb']:.1f} | "
              f"{s['controller_rss_mb']:.1f} |" for s in samples]
    lines += ["", f"keys at the last sample / at the first: {last['keys'] / first['keys']:.2f}; "
              f"agent RSS growth {last['agent_rss_mb'] / first['agent_rss_mb'] - 1:+.1%}", ""]
    write_result(args.out, "store_keys", result, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
