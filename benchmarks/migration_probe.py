"""One planned migration of a DP2 job whose state is about SIZE_MB per worker (the model of
``trainmover bench state-size``), with the leaver's transfer and the downtime printed; with
``--profile``, every process of the job sampled by py-spy into ``RUN_DIR.prof`` (collapsed
stacks: grep them for ``send_state``/``recv_state``).

    python benchmarks/migration_probe.py SIZE_MB RUN_DIR [--steps 30] [--at 10] [--profile]

A probe for finding where a switch's time goes, not a benchmark result (one run, no
repeats): ``trainmover bench state-size`` measures migrations."""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trainmover.api import Job  # noqa: E402
from trainmover.bench.state_size import job_config, size_model  # noqa: E402
from trainmover.core.events import read_jsonl  # noqa: E402
from trainmover.core.faults import Inject  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("size_mb", type=float)
    p.add_argument("run_dir")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--at", type=int, default=10, help="the step the migration is asked at")
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    cfg = job_config(size_model(args.size_mb))
    cfg.train.steps, cfg.standby.count = args.steps, 1
    job = Job(cfg, args.run_dir, timeout_s=600,
              injects=[Inject("migrate", args.at, "w1")]).start()
    prof = None
    if args.profile:
        events = os.path.join(args.run_dir, "events.jsonl")
        agent = None
        while agent is None:
            agent = next((e["pid"] for e in read_jsonl(events)
                          if e["event"] == "agent_started"), None)
            time.sleep(0.1)
        spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
        prof = subprocess.Popen([spy, "record", "--pid", str(agent), "--subprocesses",
                                 "-r", "100", "-f", "raw", "-o", args.run_dir + ".prof",
                                 "--nonblocking"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    summary = job.wait(600)
    if prof is not None:
        prof.wait(timeout=60)
    (m,) = summary["migrations"]
    print(json.dumps({"status": m["status"], "downtime_s": m.get("downtime_s"),
                      "transfer_bytes": m.get("transfer_bytes"),
                      "transfer_s": m.get("phases", {}).get("transfer_s"),
                      "switch_step": m.get("switch_step")}))


if __name__ == "__main__":
    main()
