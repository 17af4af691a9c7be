"""The commands that run a job's processes: ``run`` (the built-in trainer), ``launch`` (a
training script), ``demo``, ``controller`` (a new controller for a running job) and
``agent`` (the job's other hosts); ``--resume`` continues a stopped job."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from trainmover.core import storeaddr
from trainmover.cli.config import add_config_flag
from trainmover.cli.flags import (JOB_FLAGS, add_job_args, add_runtime_args, apply_worker_faults,
                                  build_config, build_injects, build_launch_config,
                                  python_command)


def _default_run_dir(name: str) -> str:
    return os.path.join("runs", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")


def _resume_coordinator(args: argparse.Namespace):
    from trainmover.control.coordinator import Coordinator, resumable

    given = [f for f in JOB_FLAGS if getattr(args, f, None) not in (None, False, [])]
    if getattr(args, "recipe", None) not in (None, "demo"):
        given.append("recipe")
    given += [key for key, _ in getattr(args, "overrides", [])]   # --section.field
    if given:
        raise ValueError(f"--resume continues the job with its own settings (job.json): "
                         f"drop {', '.join('--' + f.replace('_', '-') for f in given)}")
    cfg, step = resumable(args.resume)
    return Coordinator(cfg, args.resume, args.quiet, resume_from=step)


def run_until_done(coord) -> dict:
    """Run a job in this process. The first SIGTERM, SIGINT (Ctrl-C) or SIGHUP (the terminal
    closed) stops it gracefully (a checkpoint, then every process exits: resumable with
    --resume); a second one stops every process at once (committed progress and
    checkpoints stay intact)."""
    import signal

    def handler(signum, _frame):
        name = signal.Signals(signum).name
        if coord.stop_asked:
            print(f"trainmover: {name} again: stopping every process now", file=sys.stderr,
                  flush=True)
            coord.stop()
        else:
            print(f"trainmover: {name}: stopping gracefully (a checkpoint, then every process "
                  f"exits); send it again to stop at once", file=sys.stderr, flush=True)
            coord.request_stop(name)

    from trainmover.view.launch import check_dashboard, serve_when_started

    check_dashboard(coord.cfg.dashboard)
    serve_when_started(coord.started, coord.run_dir, coord.cfg.dashboard,
                       say=lambda line: print(line, flush=True))
    previous = {sig: signal.signal(sig, handler)
                for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        return coord.run(own_process=True)
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def cmd_run(args: argparse.Namespace) -> int:
    from trainmover.control.coordinator import Coordinator

    if args.resume:
        coord = _resume_coordinator(args)
    else:
        cfg = build_config(args)
        injects = build_injects(args, cfg)
        run_dir = args.run_dir or _default_run_dir(cfg.name)
        coord = Coordinator(cfg, run_dir, quiet=args.quiet, injects=injects)
    summary = run_until_done(coord)
    print(json.dumps(summary, indent=2))
    return _verdict(coord.cfg, summary)


def _verdict(cfg, summary: dict) -> int:
    """The exit code of a job that ran to its end: 1 when its data-parallel replicas ended
    with different states (unless allowed): which one is "the" model is then undefined."""
    if summary.get("replicas_agree") is False and cfg.health.replicas_must_agree:
        print("trainmover: job failed: data-parallel replicas hold different states at the "
              "end (replicas_disagree in events.jsonl names them): a script that seeds each "
              "rank differently and builds no DDP/rt.data_parallel, a non-deterministic "
              "kernel, or a bad device. --allow-replica-disagreement accepts it",
              file=sys.stderr, flush=True)
        return 1
    return 0


def cmd_launch(args: argparse.Namespace) -> int:
    from trainmover.control.coordinator import Coordinator

    if args.resume:
        if args.command:
            raise ValueError("--resume continues the job's own training command: drop the "
                             "command after '--'")
        coord = _resume_coordinator(args)
    else:
        cfg = build_launch_config(args, python_command(args.command))
        injects = build_injects(args, cfg)
        run_dir = args.run_dir or _default_run_dir(cfg.name)
        coord = Coordinator(cfg, run_dir, quiet=args.quiet, injects=injects)
    summary = run_until_done(coord)
    print(json.dumps(summary, indent=2))
    return _verdict(coord.cfg, summary)


def cmd_demo(args: argparse.Namespace) -> int:
    from trainmover.control.coordinator import run_job
    from trainmover.demo import demo_injects, print_demo_summary

    if args.standbys is None:
        args.standbys = 2
    cfg = build_config(args)
    injects = build_injects(args, cfg) if args.inject else \
        apply_worker_faults(cfg, demo_injects(cfg))
    run_dir = args.run_dir or _default_run_dir("demo")
    summary = run_job(cfg, run_dir, quiet=args.quiet, injects=injects)
    print_demo_summary(cfg, run_dir, summary)
    return 0


def cmd_controller(args: argparse.Namespace) -> int:
    from trainmover.control.coordinator import Coordinator, Superseded

    from trainmover.view.launch import check_dashboard, serve_when_started

    try:
        coord = Coordinator.resume(args.resume, quiet=args.quiet, force=args.force,
                                   node=args.node, takeover=args.takeover)
    except Superseded as exc:   # a newer controller registered first
        print(f"trainmover: this controller stepped down: {exc}", file=sys.stderr)
        return 3
    try:
        check_dashboard(coord.cfg.dashboard)
    except ValueError as exc:   # the job is running: it goes on without its dashboard
        print(f"trainmover: dashboard not started: {exc}", file=sys.stderr)
    else:
        serve_when_started(coord.started, coord.run_dir, coord.cfg.dashboard,
                           say=lambda line: print(line, flush=True))
    try:
        summary = coord.run(own_process=True)    # this process is the job's controller
    except Superseded as exc:
        print(f"trainmover: this controller stepped down: {exc}", file=sys.stderr)
        return 3
    print(json.dumps(summary, indent=2))
    return 0


def _env_int(*names: str) -> int | None:
    for name in names:
        if os.environ.get(name):
            try:
                return int(os.environ[name])
            except ValueError:
                raise ValueError(f"environment variable {name}={os.environ[name]!r} is not "
                                 f"an integer") from None
    return None


def agent_settings(args: argparse.Namespace) -> dict:
    """``trainmover agent``'s settings from its flags, else the variables the launchers set:
    torchrun's ``PET_*`` (Kubernetes PyTorchJob/TrainJob, torchrun wrappers), ``MASTER_ADDR``
    and ``MASTER_PORT``, Slurm's ``SLURM_NODEID``."""
    node = args.node_rank if args.node_rank is not None else \
        _env_int("PET_NODE_RANK", "NODE_RANK", "GROUP_RANK", "SLURM_NODEID")
    if node is None:
        raise ValueError("no node rank: pass --node-rank or set PET_NODE_RANK")
    endpoint = args.rdzv_endpoint or os.environ.get("PET_RDZV_ENDPOINT") or ""
    if not endpoint and os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        endpoint = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    if storeaddr.is_etcd(endpoint):
        storeaddr.parse_etcd(endpoint)          # names what is wrong with it
    elif endpoint and not endpoint.rpartition(":")[2].isdigit():
        raise ValueError(f"--rdzv-endpoint {endpoint!r} is not HOST:PORT or etcd://...")
    nnodes = args.nnodes if args.nnodes is not None else _env_int("PET_NNODES")
    per_node = args.nproc_per_node if args.nproc_per_node is not None else \
        _env_int("PET_NPROC_PER_NODE")
    return {"node": node, "endpoint": endpoint, "nnodes": nnodes, "nproc_per_node": per_node}


def cmd_agent(args: argparse.Namespace) -> int:
    from trainmover.agent.main import serve_host

    s = agent_settings(args)
    run_dir = os.path.abspath(args.run_dir)
    code = serve_host(run_dir, s["endpoint"], s["node"], args.address, args.connect_timeout,
                      expect={"nnodes": s["nnodes"], "nproc_per_node": s["nproc_per_node"]})
    return code


def add_run_parser(sub) -> None:
    run = sub.add_parser("run", help="run a local job")
    add_job_args(run, "demo")
    add_config_flag(run, "the recipe")
    run.set_defaults(fn=cmd_run)


def add_launch_parser(sub) -> None:
    launch = sub.add_parser(
        "launch", help="run your own training script under trainmover",
        usage="trainmover launch [--dp N --pp N --tp N | --nproc N] [OPTIONS] -- "
              "python SCRIPT [ARGS]")
    launch.add_argument("--nproc", type=int, help="workers, data parallel (dp = N)")
    launch.add_argument("--dp", type=int,
                        help="data-parallel degree: replicas (with --dp-sharded, shards) of "
                             "the script's model (default 1, or the --config file's)")
    launch.add_argument("--pp", type=int,
                        help="pipeline-parallel degree: the script's pipeline stages "
                             "(default 1, or the --config file's)")
    launch.add_argument("--tp", type=int,
                        help="tensor-parallel degree: ranks that split each layer "
                             "(default 1, or the --config file's)")
    launch.add_argument("--dp-sharded", action="store_true",
                        help="the data-parallel roles hold shards of the state, not replicas "
                             "(FSDP2 or ZeRO over the dp axis): recovered from a snapshot or "
                             "checkpoint, never from another dp role")
    launch.add_argument("--steps", type=int,
                        help="the script's step count, if known (progress, inject checks)")
    launch.add_argument("--threads", type=int, help="intra-op threads per worker "
                                                    "(default: cores / processes)")
    launch.add_argument("--run-dir", help="output directory (default: runs/<script>-<time>)")
    launch.add_argument("--resume", metavar="RUN_DIR",
                        help="continue a stopped job from its newest intact checkpoint, with "
                             "its own settings and command")
    add_runtime_args(launch)
    add_config_flag(launch, "the defaults")
    launch.set_defaults(fn=cmd_launch, command=[])


def add_demo_parser(sub) -> None:
    demo = sub.add_parser("demo", help="a small multi-worker job on the built-in corpus")
    add_job_args(demo, "demo")
    demo.set_defaults(fn=cmd_demo)


def add_controller_parser(sub) -> None:
    ctl = sub.add_parser("controller", help="take control of a running job whose controller "
                                            "died (training never stopped)")
    ctl.add_argument("--resume", required=True, metavar="RUN_DIR", help="the job's run dir")
    ctl.add_argument("--force", action="store_true",
                     help="take over even if the current controller is alive (it steps down)")
    ctl.add_argument("--quiet", action="store_true",
                     help="print no progress (step lines, messages); the summary is still "
                          "printed at the end")
    ctl.add_argument("--node", type=int, default=0,
                     help="the host this controller runs on (default 0)")
    ctl.add_argument("--takeover", action="store_true",
                     help="started by this host's agent because the controller's host fell "
                          "silent (needs the store on etcd)")
    ctl.set_defaults(fn=cmd_controller)


def add_agent_parser(sub) -> None:
    agent = sub.add_parser(
        "agent", help="serve one more host of a job (its workers and standbys)",
        description="Run on every host but the controller's (host 0), e.g. from srun or a "
                    "Kubernetes pod. Flags follow torchrun; each falls back to the variable "
                    "in brackets.")
    agent.add_argument("--run-dir", required=True, help="the job's run dir, on a filesystem "
                                                        "every host shares")
    agent.add_argument("--node-rank", type=int, help="this host's index, 1.. "
                                                     "[PET_NODE_RANK, SLURM_NODEID]")
    agent.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                       help="the job's store, HOST:PORT or etcd://... [PET_RDZV_ENDPOINT, "
                            "MASTER_ADDR:MASTER_PORT; default: the run dir's control.json]")
    agent.add_argument("--nnodes", type=int, help="checked against the job [PET_NNODES]")
    agent.add_argument("--nproc-per-node", type=int,
                       help="checked against the job [PET_NPROC_PER_NODE]")
    agent.add_argument("--address", help="this host's address on the job's network (its "
                                         "workers bind their communication to it)")
    agent.add_argument("--connect-timeout", type=float, default=300.0,
                       help="how long to wait for the job to start (seconds)")
    agent.set_defaults(fn=cmd_agent)
