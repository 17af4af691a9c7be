"""The job's store for ``trainmover bench control``, served alone in this process (a job's
is served by a thread of host 0's agent, whose own loop is light), with the count of the
requests it served written to a file every ``--interval`` seconds: ``time requests`` lines.
Run by the benchmark, never by a job; stopped by it (its PID)."""
from __future__ import annotations

import argparse
import signal
import sys
import time

from trainmover.core import jobfile, kvserver, kvstore
from trainmover.core.proc import PR_SET_PDEATHSIG, prctl, raise_open_files


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="trainmover.bench.control_store")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--listen-fd", type=int, required=True)
    p.add_argument("--stats", required=True)
    p.add_argument("--interval", type=float, default=0.25)
    args = p.parse_args(argv)
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    raise_open_files(1 << 20)   # four connections a simulated worker, as in a job
    cfg = jobfile.read_job(args.run_dir)
    server = kvserver.serve(jobfile.run_key(args.run_dir), listen_fd=args.listen_fd,
                            limits=kvstore.StoreLimits.of(cfg.comm))
    with open(args.stats, "w") as f:
        while True:
            f.write(f"{time.time():.6f} {server.requests}\n")
            f.flush()
            time.sleep(args.interval)


if __name__ == "__main__":
    sys.exit(main())
