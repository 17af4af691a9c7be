"""The operator's commands on a job, running or ended, named by its run dir: ``migrate``,
``status``, ``drain``, ``dashboard``, ``report`` and ``stop``."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def cmd_migrate(args: argparse.Namespace) -> int:
    from trainmover.control.client import request_migration

    result = request_migration(args.run_dir, args.worker, args.to, wait=not args.no_wait,
                               timeout_s=args.timeout)
    print(json.dumps(result, indent=2))
    return 0 if result.get("status") in ("done", "started", "queued") else 1


def cmd_status(args: argparse.Namespace) -> int:
    import dataclasses

    from trainmover.control.status import ended, read_status, render, render_ended
    from trainmover.control.status_file import fresh_limit_s, read_status_file

    fresh_s = fresh_limit_s(args.run_dir)
    store = None
    while True:
        # the controller's status.json while it is fresh (no torch import, no store); else
        # the store, which also answers while the controller is down; a job whose processes
        # are all gone: its summary (finished, stopped) or how it ended
        outcome = ended(args.run_dir, fresh_s)   # status.json may still look fresh then
        if outcome is not None:
            print(json.dumps(outcome, indent=2) if args.json else
                  render_ended(args.run_dir, outcome), flush=True)
            return 0
        st = read_status_file(args.run_dir, fresh_s)
        if st is None:
            from trainmover.control.client import connect
            store = store or connect(args.run_dir)
            st = read_status(args.run_dir, store)
        if args.json:   # "state" as for an ended job's outcome, for scripts
            print(json.dumps({"state": "running", **dataclasses.asdict(st)}, indent=2))
        else:
            page = render(st)
            print(("\x1b[H\x1b[2J" if args.watch and sys.stdout.isatty() else "") + page,
                  flush=True)
        if not args.watch:
            return 0
        time.sleep(args.interval)


def cmd_drain(args: argparse.Namespace) -> int:
    from trainmover.control.maintenance import drain

    result = drain(args.run_dir, args.worker, args.host, timeout_s=args.timeout)
    print(json.dumps({k: v for k, v in result.items() if k != "batches"}, indent=2))
    return 0 if result["status"] == "done" else 1


def cmd_dashboard(args: argparse.Namespace) -> int:
    from trainmover.core.config import DashboardConfig
    from trainmover.view.launch import announce, check_dashboard
    from trainmover.view.server import start_dashboard

    if not os.path.exists(os.path.join(args.run_dir, "events.jsonl")):
        raise ValueError(f"--run-dir {args.run_dir!r} holds no job (no events.jsonl)")
    cfg = DashboardConfig(port=args.port, host=args.host)
    cfg.validate()
    check_dashboard(cfg)
    board = start_dashboard(args.run_dir, cfg)
    print(announce(board, args.run_dir) if not args.url else board.login_url, flush=True)
    try:
        while board.thread.is_alive():
            board.thread.join(1.0)
    except KeyboardInterrupt:
        board.stop()
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from trainmover.view.report import write_report

    if not os.path.exists(os.path.join(args.run_dir, "events.jsonl")):
        raise ValueError(f"{args.run_dir!r} holds no job (no events.jsonl)")
    for path in args.bench or []:
        if not os.path.isfile(path):
            raise ValueError(f"--bench {path!r}: no such file")
    paths = write_report(args.run_dir, args.out, args.bench)
    print(json.dumps(paths, indent=2))
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    from trainmover.control.client import request_stop

    summary = request_stop(args.run_dir, args.reason, wait=not args.no_wait,
                           timeout_s=args.timeout)
    print(json.dumps(summary, indent=2))
    return 0 if summary.get("status") in ("stopped", "requested", "finished") else 1


def _job_command(sub, name: str, help: str) -> argparse.ArgumentParser:
    """A command that acts on a running job, named by its run dir."""
    p = sub.add_parser(name, help=help)
    p.add_argument("--run-dir", required=True, help="run directory of a running job")
    return p


def add_migrate_parser(sub) -> None:
    mig = _job_command(sub, "migrate", "hand running workers' roles to standbys")
    mig.add_argument("--worker", action="append", required=True,
                     help="worker to migrate (repeat for several at once)")
    mig.add_argument("--to", action="append", help="standby to migrate to (one per --worker)")
    mig.add_argument("--no-wait", action="store_true", help="return once the request is queued")
    mig.add_argument("--timeout", type=float, default=600.0,
                     help="seconds to wait for the controller's answer (the migration done, "
                          "refused or aborted; with --no-wait, its first status) before "
                          "reporting status timeout; the request stays queued")
    mig.set_defaults(fn=cmd_migrate)


def add_status_parser(sub) -> None:
    stat = _job_command(sub, "status", "a running job: roles, standbys, steps, what is "
                                       "in flight, per-worker step times")
    stat.add_argument("--json", action="store_true", help="one JSON object (for scripts)")
    stat.add_argument("--watch", action="store_true", help="refresh until interrupted")
    stat.add_argument("--interval", type=float, default=1.0, help="--watch refresh (s)")
    stat.set_defaults(fn=cmd_status)


def add_drain_parser(sub) -> None:
    dr = _job_command(sub, "drain", "move workers (or every worker of a host) to standbys, "
                                    "as many at once as standbys allow, and report when "
                                    "they are free (maintenance)")
    dr.add_argument("--worker", action="append", help="worker to move (repeatable)")
    dr.add_argument("--host", type=int, help="move every worker of this host (its index)")
    dr.add_argument("--timeout", type=float, default=600.0, help="per batch")
    dr.set_defaults(fn=cmd_drain)


def add_dashboard_parser(sub) -> None:
    dash = sub.add_parser("dashboard", help="serve the live dashboard and Prometheus /metrics "
                                            "of a job (running or finished)")
    dash.add_argument("--run-dir", required=True, help="the job's run directory")
    dash.add_argument("--port", type=int, default=0, help="TCP port (default 0: any free)")
    dash.add_argument("--host", default="127.0.0.1", help="address to listen on")
    dash.add_argument("--url", action="store_true",
                      help="print the sign-in link (a credential) even when not on a terminal")
    dash.set_defaults(fn=cmd_dashboard)


def add_report_parser(sub) -> None:
    rep = sub.add_parser("report", help="PNG plots and one self-contained HTML page of a run "
                                        "(into RUN_DIR/report/)")
    rep.add_argument("run_dir", metavar="RUN_DIR",
                     help="the job's run directory (running or finished: its events.jsonl)")
    rep.add_argument("--out", help="output directory (default RUN_DIR/report)")
    rep.add_argument("--bench", action="append", metavar="FILE",
                     help="a bench result (benchmarks/results/*.json) to plot beside it")
    rep.set_defaults(fn=cmd_report)


def add_stop_parser(sub) -> None:
    stop = _job_command(sub, "stop", "stop a running job gracefully (a checkpoint, then "
                                     "every process exits); continue it with --resume")
    stop.add_argument("--reason", default="trainmover stop", help="recorded in the events")
    stop.add_argument("--no-wait", action="store_true", help="return once the request is sent")
    stop.add_argument("--timeout", type=float, default=600.0,
                      help="seconds to wait for every process of the job to exit before "
                           "reporting status timeout (the stop goes on)")
    stop.set_defaults(fn=cmd_stop)
