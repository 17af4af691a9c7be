"""``trainmover`` command line: run, demo, bench. Kept small: recipes carry the settings."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from trainmover.config_command import add_config_flag, add_config_parser
from trainmover.core.config import JobConfig
from trainmover.core.config_file import apply_job_file, apply_overrides, split_overrides
from trainmover.recipes import RECIPES, get_recipe
from trainmover.core.topology import Layout


# the runtime flags of run, demo and launch -> the setting each overrides (JobConfig.override)
RUNTIME_FLAGS = {"device": "process_device", "standbys": "standby_count",
                 "checkpoint_every": "checkpoint_every", "keep_checkpoints": "checkpoint_keep",
                 "snapshot_every": "snapshot_every", "stragglers": "straggler_policy",
                 "rebalance_every": "maintenance_rebalance_every_s",
                 "dashboard": "dashboard_port", "dashboard_host": "dashboard_host",
                 "controller_restart": "controller_restart", "verify_every": "health_verify_every",
                 "nnodes": "hosts_nnodes", "nproc_per_node": "hosts_nproc_per_node",
                 "store_host": "process_store_host", "store_port": "process_store_port",
                 "allow_remote": "process_allow_remote",
                 "allow_replica_disagreement": "health_replicas_must_agree"}


def apply_runtime_args(cfg: JobConfig, args: argparse.Namespace) -> None:
    cfg.override(**{setting: getattr(args, flag) for flag, setting in RUNTIME_FLAGS.items()
                    if getattr(args, flag, None) is not None})


def build_config(args: argparse.Namespace) -> JobConfig:
    """Recipe < job file (--config) < flags < --section.field overrides, fully validated
    (raises ValueError naming the value)."""
    cfg = get_recipe(args.recipe)
    if getattr(args, "config", None):
        apply_job_file(cfg, args.config)
    if any(v is not None for v in (args.dp, args.pp, args.tp)):
        cfg.layout = Layout(args.dp if args.dp is not None else cfg.layout.dp,
                            args.pp if args.pp is not None else cfg.layout.pp,
                            args.tp if args.tp is not None else cfg.layout.tp,
                            dp_sharded=cfg.layout.dp_sharded)
    if args.steps is not None:
        cfg.train.steps = args.steps
    if args.seed is not None:
        cfg.train.seed = args.seed
    if getattr(args, "compile", False):
        cfg.train.compile = True
    if args.data is not None:
        cfg.data.source = args.data
    if args.data_format is not None:
        cfg.data.format = args.data_format
    apply_runtime_args(cfg, args)
    apply_overrides(cfg, getattr(args, "overrides", []))
    cfg.validate()
    if args.workers is not None and args.workers != cfg.layout.num_roles:
        raise ValueError(f"--workers={args.workers} does not match layout {cfg.layout} "
                         f"(dp*pp*tp = {cfg.layout.num_roles})")
    return cfg


def build_injects(args: argparse.Namespace, cfg: JobConfig) -> list:
    from trainmover.control.coordinator import worker_names
    from trainmover.core.faults import parse_inject, validate_injects

    injects = [parse_inject(text) for text in (args.inject or [])]
    validate_injects(injects, cfg.train.steps, worker_names(cfg.layout.num_roles),
                     worker_names(cfg.standby.count, "s"))
    return apply_worker_faults(cfg, injects)


def apply_worker_faults(cfg: JobConfig, injects: list) -> list:
    """Faults the workers carry out go into the job's configuration; the rest (migrations,
    the controller's own crashes) stay with the controller, which is what this returns."""
    from trainmover.core.faults import worker_faults

    faults = worker_faults(injects)
    if any(f["point"] == "checkpoint" for f in faults) and not cfg.checkpoint.every:
        raise ValueError("a fault at point 'checkpoint' needs checkpoints: add "
                         "--checkpoint-every N")
    cfg.faults = list(cfg.faults) + faults
    return [i for i in injects if i.kind == "migrate" or i.target == "controller"]


def _job_args(p: argparse.ArgumentParser, default_recipe: str) -> None:
    p.add_argument("--recipe", default=default_recipe,
                   help=f"named recipe ({', '.join(sorted(RECIPES))})")
    p.add_argument("--dp", type=int,
                   help="data-parallel degree: replicas of the model, each training on its "
                        "share of the batch (default: the recipe's, or the --config file's)")
    p.add_argument("--pp", type=int,
                   help="pipeline-parallel degree: stages the model's blocks are split over "
                        "(default: the recipe's)")
    p.add_argument("--tp", type=int,
                   help="tensor-parallel degree: ranks that split each layer's weights "
                        "(default: the recipe's)")
    p.add_argument("--workers", type=int, help="expected worker count (checked against dp*pp*tp)")
    p.add_argument("--steps", type=int,
                   help="training steps (train.steps; default: the recipe's)")
    p.add_argument("--seed", type=int,
                   help="seed of the initial weights, the batches sampled and dropout "
                        "(train.seed; default: the recipe's)")
    p.add_argument("--compile", action="store_true", help="torch.compile each stage module")
    p.add_argument("--data", help="text file (bytes as tokens) or uint16 token file")
    p.add_argument("--data-format", choices=["text", "uint16"],
                   help="how --data is read: text (each byte a token) or uint16 (a flat "
                        "little-endian token file) (data.format; default text)")
    _runtime_args(p)
    p.add_argument("--run-dir", help="output directory (default: runs/<recipe>-<time>)")
    p.add_argument("--resume", metavar="RUN_DIR",
                   help="continue a stopped job from its newest intact checkpoint, with its "
                        "own settings")


def _runtime_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=["cpu", "cuda"],
                   help="where the processes compute: cpu, or cuda, each process on its "
                        "slot's GPU (process.device; default cpu)")
    p.add_argument("--standbys", type=int, help="standby processes started with the job")
    p.add_argument("--checkpoint-every", type=int, metavar="N",
                   help="asynchronous checkpoint every N steps (default 50; 0: off): the "
                        "recovery source of a failed role without a data-parallel replica, "
                        "and where `run --resume` continues from")
    p.add_argument("--snapshot-every", type=int, metavar="N",
                   help="a job without data-parallel replicas (dp 1) sends each role's state "
                        "to another host's memory every N steps (default 10; 0: off): a "
                        "failure replays at most N steps and reads no disk")
    p.add_argument("--stragglers", choices=["off", "alert", "migrate"],
                   help="slow workers: not watched, reported (default), or also moved to a "
                        "warm standby when staying slow would cost more than moving")
    p.add_argument("--rebalance-every", type=float, metavar="SECONDS",
                   help="rolling maintenance: every SECONDS move the next worker (in turn) "
                        "onto a warm standby (default 0: never)")
    p.add_argument("--dashboard", type=int, metavar="PORT",
                   help="serve a live dashboard and Prometheus /metrics on PORT (0: any free "
                        "port); the sign-in link is printed on a terminal and written to "
                        "<run dir>/dashboard.json")
    p.add_argument("--dashboard-host", metavar="ADDR",
                   help="address the dashboard listens on (default 127.0.0.1)")
    p.add_argument("--verify-every", type=int, metavar="N",
                   help="compare the data-parallel replicas' state digests every N steps "
                        "(default 0: at the end only)")
    p.add_argument("--allow-replica-disagreement", action="store_const", const=False,
                   help="end with exit code 0 even when data-parallel replicas hold different "
                        "states at the end (a script whose replicas legitimately differ); by "
                        "default that fails the job: its weights would depend on the replica")
    p.add_argument("--keep-checkpoints", type=int, metavar="N",
                   help="complete checkpoints kept on disk (default 2; older ones deleted)")
    p.add_argument("--controller-restart", choices=["auto", "manual"],
                   help="if this controller process dies: the job's agent starts a new one "
                        "(auto, default) or waits for `trainmover controller --resume` (manual)")
    p.add_argument("--inject", action="append", metavar="KIND@STEP:TARGET[:ARG]",
                   help="scheduled event, e.g. migrate@12:w3 (repeatable)")
    p.add_argument("--nnodes", type=int, help="hosts of the job (this is host 0; start "
                                              "`trainmover agent` on each other one)")
    p.add_argument("--nproc-per-node", type=int, help="worker slots per host")
    p.add_argument("--store-host", help="address the job's store listens on (default "
                                        "127.0.0.1; with several hosts, this host's address "
                                        "on the cluster's private network)")
    p.add_argument("--store-port", type=int, help="the store's port (default: any free one)")
    p.add_argument("--allow-remote", action="store_true", default=None,
                   help="let the store (--store-host) or the dashboard (--dashboard-host) "
                        "listen on an address other than loopback: a private cluster "
                        "network only (docs/security.md)")
    p.add_argument("--quiet", action="store_true",
                   help="print no progress (step lines, the controller's messages); the "
                        "summary is still printed, and the run dir's events.jsonl and "
                        "metrics.jsonl have everything")


def python_command(command: list[str]) -> list[str]:
    """``python SCRIPT ARGS`` or ``python -m MODULE ARGS`` -> what follows ``python``: the
    script runs inside trainmover's worker processes (a standby runs it several times)."""
    if not command:
        raise ValueError("no training command after '--': expected "
                         "`trainmover launch [OPTIONS] -- python SCRIPT [ARGS]`")
    exe = os.path.basename(command[0])
    if not (exe.startswith("python") or command[0] == sys.executable):
        raise ValueError(f"the training command must start with a Python interpreter "
                         f"(python SCRIPT ARGS or python -m MODULE ARGS), got {command[0]!r}")
    rest = list(command[1:])
    if not rest:
        raise ValueError(f"{command[0]!r} is given no script or module to run")
    if rest[0] not in ("-m",) and rest[0].startswith("-"):
        raise ValueError(f"interpreter option {rest[0]!r} is not supported: give "
                         f"python SCRIPT ARGS or python -m MODULE ARGS")
    if rest[0] != "-m":
        rest[0] = os.path.abspath(rest[0])
    return rest


def build_launch_config(args: argparse.Namespace, command: list[str]) -> JobConfig:
    cfg = JobConfig(name=os.path.splitext(os.path.basename(
        command[1] if command[0] == "-m" else command[0]))[0].split(".")[-1])
    cfg.train.steps = 0     # the script's step count: unknown unless told
    if getattr(args, "config", None):
        apply_job_file(cfg, args.config)
    if args.nproc is not None and any(v is not None for v in (args.dp, args.pp, args.tp)):
        raise ValueError("give either --nproc N (data parallel) or --dp/--pp/--tp, not both")
    sharded = bool(getattr(args, "dp_sharded", False)) or cfg.layout.dp_sharded
    if args.nproc is not None:
        cfg.layout = Layout(args.nproc, 1, 1, dp_sharded=sharded)
    else:
        cfg.layout = Layout(args.dp or cfg.layout.dp, args.pp or cfg.layout.pp,
                            args.tp or cfg.layout.tp, dp_sharded=sharded)
    cfg.process.command = command
    if args.steps is not None:
        cfg.train.steps = args.steps
    if args.threads is not None:
        cfg.train.threads_per_worker = args.threads
    apply_runtime_args(cfg, args)
    apply_overrides(cfg, getattr(args, "overrides", []))
    return cfg.validate()


def _default_run_dir(name: str) -> str:
    return os.path.join("runs", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")


# the flags that define a job: with --resume, the job's own settings (job.json) apply
JOB_FLAGS = ("dp", "pp", "tp", "nproc", "workers", "steps", "seed", "compile", "data",
             "data_format", "threads", "inject", "run_dir", "config", *RUNTIME_FLAGS)


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
        return coord.run()
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


def cmd_stop(args: argparse.Namespace) -> int:
    from trainmover.control.client import request_stop

    summary = request_stop(args.run_dir, args.reason, wait=not args.no_wait,
                           timeout_s=args.timeout)
    print(json.dumps(summary, indent=2))
    return 0 if summary.get("status") in ("stopped", "requested", "finished") else 1


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

    coord = Coordinator.resume(args.resume, quiet=args.quiet, force=args.force)
    try:
        check_dashboard(coord.cfg.dashboard)
    except ValueError as exc:   # the job is running: it goes on without its dashboard
        print(f"trainmover: dashboard not started: {exc}", file=sys.stderr)
    else:
        serve_when_started(coord.started, coord.run_dir, coord.cfg.dashboard,
                           say=lambda line: print(line, flush=True))
    try:
        summary = coord.run()
    except Superseded as exc:
        print(f"trainmover: this controller stepped down: {exc}", file=sys.stderr)
        return 3
    print(json.dumps(summary, indent=2))
    return 0


def cmd_migrate(args: argparse.Namespace) -> int:
    from trainmover.control.client import request_migration

    result = request_migration(args.run_dir, args.worker, args.to, wait=not args.no_wait,
                               timeout_s=args.timeout)
    print(json.dumps(result, indent=2))
    return 0 if result.get("status") in ("done", "started", "queued") else 1


def cmd_status(args: argparse.Namespace) -> int:
    import dataclasses

    from trainmover.control.status import (ended, fresh_limit_s, read_status,
                                           read_status_file, render, render_ended)

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


def cmd_drain(args: argparse.Namespace) -> int:
    from trainmover.control.maintenance import drain

    result = drain(args.run_dir, args.worker, args.host, timeout_s=args.timeout)
    print(json.dumps({k: v for k, v in result.items() if k != "batches"}, indent=2))
    return 0 if result["status"] == "done" else 1


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
    if endpoint and not endpoint.rpartition(":")[2].isdigit():
        raise ValueError(f"--rdzv-endpoint {endpoint!r} is not HOST:PORT")
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


def cmd_bench(args: argparse.Namespace) -> int:
    from trainmover.bench.main import main

    return main(args)


def _job_command(sub, name: str, help: str) -> argparse.ArgumentParser:
    """A command that acts on a running job, named by its run dir."""
    p = sub.add_parser(name, help=help)
    p.add_argument("--run-dir", required=True, help="run directory of a running job")
    return p


def _bench_parser(bsub, name: str, help: str, recipe: str = "demo",
                  repeats: bool = True) -> argparse.ArgumentParser:
    """A ``trainmover bench`` subcommand with the flags every bench has."""
    p = bsub.add_parser(name, help=help)
    if repeats:
        p.add_argument("--repeats", type=int, default=3,
                       help="rounds of the benchmark's runs, interleaved (figures: median, "
                            "min and max over the rounds)")
    p.add_argument("--recipe", default=recipe,
                   help="recipe of the measured jobs' model and training (the benchmark sets "
                        "their layout)")
    p.add_argument("--out", default="benchmarks/results",
                   help="directory of the result (a .json file and its .md report)")
    p.set_defaults(fn=cmd_bench)
    return p


def cmd_project(args: argparse.Namespace) -> int:
    from dataclasses import fields

    from trainmover.bench.project import Cluster, costs_from_bench, write_projection

    cluster = Cluster(**{f.name: getattr(args, f.name) for f in fields(Cluster)
                         if getattr(args, f.name) is not None})
    cluster.validate()
    write_projection(cluster, costs_from_bench(args.bench), args.out, args.name)
    return 0


def _project_parser(sub) -> None:
    from dataclasses import fields

    from trainmover.bench.project import Cluster

    p = sub.add_parser("project", help="ETTR and GPU-hours lost per week at 1K-128K GPUs, "
                                       "from measured per-event costs (a model)")
    p.add_argument("--bench", action="append", required=True, metavar="FILE",
                   help="a `trainmover bench downtime` or `bench quick` result (a planned "
                        "migration and a crash recovery at least; give several files to "
                        "combine them)")
    p.add_argument("--out", default="benchmarks/results",
                   help="directory the projection is written to (see --name)")
    p.add_argument("--name", default="projection",
                   help="result file name under --out (NAME.json, .md, .png)")
    defaults = Cluster()
    for f in fields(Cluster):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "gpus":
            p.add_argument(flag, type=lambda s: [int(x) for x in s.split(",")], default=None,
                           help="comma-separated cluster sizes (default "
                                f"{','.join(map(str, defaults.gpus))})")
        else:
            kind = type(getattr(defaults, f.name))
            p.add_argument(flag, type=kind, default=None,
                           help=f"default {getattr(defaults, f.name)}")
    p.set_defaults(fn=cmd_project)


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trainmover",
                                description="Keep distributed PyTorch training running through "
                                            "interruptions.")
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a local job")
    _job_args(run, "demo")
    add_config_flag(run, "the recipe")
    run.set_defaults(fn=cmd_run)
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
    _runtime_args(launch)
    add_config_flag(launch, "the defaults")
    launch.set_defaults(fn=cmd_launch, command=[])
    add_config_parser(sub)
    demo = sub.add_parser("demo", help="a small multi-worker job on the built-in corpus")
    _job_args(demo, "demo")
    demo.set_defaults(fn=cmd_demo)
    ctl = sub.add_parser("controller", help="take control of a running job whose controller "
                                            "died (training never stopped)")
    ctl.add_argument("--resume", required=True, metavar="RUN_DIR", help="the job's run dir")
    ctl.add_argument("--force", action="store_true",
                     help="take over even if the current controller is alive (it steps down)")
    ctl.add_argument("--quiet", action="store_true",
                     help="print no progress (step lines, messages); the summary is still "
                          "printed at the end")
    ctl.set_defaults(fn=cmd_controller)
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
    stat = _job_command(sub, "status", "a running job: roles, standbys, steps, what is "
                                       "in flight, per-worker step times")
    stat.add_argument("--json", action="store_true", help="one JSON object (for scripts)")
    stat.add_argument("--watch", action="store_true", help="refresh until interrupted")
    stat.add_argument("--interval", type=float, default=1.0, help="--watch refresh (s)")
    stat.set_defaults(fn=cmd_status)
    dr = _job_command(sub, "drain", "move workers (or every worker of a host) to standbys, "
                                    "as many at once as standbys allow, and report when "
                                    "they are free (maintenance)")
    dr.add_argument("--worker", action="append", help="worker to move (repeatable)")
    dr.add_argument("--host", type=int, help="move every worker of this host (its index)")
    dr.add_argument("--timeout", type=float, default=600.0, help="per batch")
    dr.set_defaults(fn=cmd_drain)
    dash = sub.add_parser("dashboard", help="serve the live dashboard and Prometheus /metrics "
                                            "of a job (running or finished)")
    dash.add_argument("--run-dir", required=True, help="the job's run directory")
    dash.add_argument("--port", type=int, default=0, help="TCP port (default 0: any free)")
    dash.add_argument("--host", default="127.0.0.1", help="address to listen on")
    dash.add_argument("--url", action="store_true",
                      help="print the sign-in link (a credential) even when not on a terminal")
    dash.set_defaults(fn=cmd_dashboard)
    rep = sub.add_parser("report", help="PNG plots and one self-contained HTML page of a run "
                                        "(into RUN_DIR/report/)")
    rep.add_argument("run_dir", metavar="RUN_DIR",
                     help="the job's run directory (running or finished: its events.jsonl)")
    rep.add_argument("--out", help="output directory (default RUN_DIR/report)")
    rep.add_argument("--bench", action="append", metavar="FILE",
                     help="a bench result (benchmarks/results/*.json) to plot beside it")
    rep.set_defaults(fn=cmd_report)
    _project_parser(sub)
    stop = _job_command(sub, "stop", "stop a running job gracefully (a checkpoint, then "
                                     "every process exits); continue it with --resume")
    stop.add_argument("--reason", default="trainmover stop", help="recorded in the events")
    stop.add_argument("--no-wait", action="store_true", help="return once the request is sent")
    stop.add_argument("--timeout", type=float, default=600.0,
                      help="seconds to wait for every process of the job to exit before "
                           "reporting status timeout (the stop goes on)")
    stop.set_defaults(fn=cmd_stop)
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
                       help="the job's store [PET_RDZV_ENDPOINT, MASTER_ADDR:MASTER_PORT; "
                            "default: the run dir's control.json]")
    agent.add_argument("--nnodes", type=int, help="checked against the job [PET_NNODES]")
    agent.add_argument("--nproc-per-node", type=int,
                       help="checked against the job [PET_NPROC_PER_NODE]")
    agent.add_argument("--address", help="this host's address on the job's network (its "
                                         "workers bind their communication to it)")
    agent.add_argument("--connect-timeout", type=float, default=300.0,
                       help="how long to wait for the job to start (seconds)")
    agent.set_defaults(fn=cmd_agent)
    bench = sub.add_parser("bench", help="benchmarks (results under benchmarks/results/)")
    bsub = bench.add_subparsers(dest="bench", required=True)
    step = bsub.add_parser("step", help="engine step time vs DistributedDataParallel (DP only)")
    step.add_argument("--recipe", default="bench_step",
                      help="recipe of the model and training measured (its layout is "
                           "replaced by --dp)")
    step.add_argument("--dp", type=int, default=2,
                      help="data-parallel processes (the layout is dp x 1 x 1)")
    step.add_argument("--steps", type=int, default=30,
                      help="steps per run (more than 7: the first 5 are warm-up, left out)")
    step.add_argument("--repeats", type=int, default=3,
                      help="rounds, each running every strategy once in a rotating order "
                           "(figures: the median over the rounds)")
    step.add_argument("--out", default="benchmarks/results",
                      help="directory of the result (step.json and step.md)")
    step.set_defaults(fn=cmd_bench)
    ex = bsub.add_parser("example", help="examples/ddp_gpt.py (or --script torch_ddp) under "
                                         "trainmover vs the plain DDP script under torchrun "
                                         "(run from the repo root)")
    ex.add_argument("--script", choices=("ddp_gpt", "torch_ddp", "torch_fsdp", "torch_fsdp_tp",
                                         "torch_pipeline"),
                    default="ddp_gpt",
                    help="ddp_gpt: trainmover's data-parallel wrapper; torch_ddp: torch's "
                         "DistributedDataParallel on trainmover's process groups; "
                         "torch_fsdp: FSDP2 on them (--dp-sharded); torch_fsdp_tp: FSDP2 + "
                         "tensor parallel (--dp 2 --tp 2); torch_pipeline: pipelining + "
                         "FSDP2 (--dp 2 --pp 2)")
    ex.add_argument("--nproc", type=int, default=2,
                    help="data-parallel processes (torch_fsdp_tp and torch_pipeline ignore "
                         "it: their layout has 4)")
    ex.add_argument("--steps", type=int, default=40,
                    help="steps per run (more than 10: the first 5 are warm-up, left out)")
    ex.add_argument("--repeats", type=int, default=3,
                    help="runs of each side, alternating (figures: median, min and max of "
                         "the runs' median step times)")
    ex.add_argument("--out", default="benchmarks/results",
                    help="directory of the result (example_overhead[_SCRIPT].json and .md)")
    ex.set_defaults(fn=cmd_bench)
    exd = bsub.add_parser("example-downtime",
                          help="a planned migration's and a crash's downtime for the FSDP2 + "
                               "TP example against the built-in trainer's, same layout and "
                               "model (run from the repo root)")
    exd.add_argument("--repeats", type=int, default=3,
                     help="runs of each cell (planned, crash x script, built-in), the two "
                          "trainers interleaved")
    exd.add_argument("--steps", type=int, default=40, help="steps of each job")
    exd.add_argument("--event-step", type=int, default=20,
                     help="the step at which w1 is migrated or crashed (at least 6 steps "
                          "before the job's end)")
    exd.add_argument("--checkpoint-every", type=int, default=5,
                     help="the FSDP2 script's checkpoint interval (steps): a crash rolls "
                          "every role back to the newest checkpoint")
    exd.add_argument("--out", default="benchmarks/results",
                     help="directory of the result (example_downtime_torch_fsdp_tp.json "
                          "and .md)")
    exd.set_defaults(fn=cmd_bench)
    ck = bsub.add_parser("checkpoint", help="periodic checkpoints' cost to the step, per "
                                            "interval, against checkpoints off")
    ck.add_argument("--intervals", default="10,50", help="comma list of checkpoint intervals")
    ck.add_argument("--steps", type=int, default=130,
                    help="steps per run (more than 5 warm-up steps + twice the largest "
                         "interval)")
    ck.add_argument("--repeats", type=int, default=3,
                    help="rounds, each running checkpoints off and every interval once, in "
                         "a rotating order")
    ck.add_argument("--recipe", default="demo",
                    help="recipe of the measured job (run as DP2 x PP2, no standbys)")
    ck.add_argument("--out", default="benchmarks/results",
                    help="directory of the result (checkpoint_cost.json and .md)")
    ck.set_defaults(fn=cmd_bench)
    src = bsub.add_parser("sources", help="a crash recovered from a replica, an in-memory "
                                          "snapshot and a disk checkpoint, side by side")
    src.add_argument("--repeats", type=int, default=3,
                     help="rounds, each running the replica, snapshot and checkpoint cells "
                          "once, in a rotating order")
    src.add_argument("--steps", type=int, default=60, help="steps of each job")
    src.add_argument("--every", type=int, default=10,
                     help="snapshot / checkpoint interval (steps)")
    src.add_argument("--crash-step", type=int, default=27,
                     help="the step at whose start the first stage's dp0 worker is killed "
                          "(1 to --steps minus 6)")
    src.add_argument("--recipe", default="demo",
                     help="recipe of the jobs (run as DP2 x PP2 for the replica cell, DP1 x "
                          "PP2 for the others)")
    src.add_argument("--out", default="benchmarks/results",
                     help="directory of the result (recovery_sources.json and .md)")
    src.set_defaults(fn=cmd_bench)
    fp = _bench_parser(bsub, "false-positives", "the straggler detector on healthy jobs "
                                                "(plain, all slowed, a heavier last stage)",
                       recipe="tiny", repeats=False)
    fp.add_argument("--runs", type=int, default=21,
                    help="jobs run, cycling over the three cases, each with its own seed "
                         "(at least 3)")
    fp.add_argument("--steps", type=int, default=200, help="steps of each job")
    et = _bench_parser(bsub, "ettr", "effective training time ratio with a worker moved to a "
                                     "standby every --every seconds, beside restart")
    et.add_argument("--minutes", type=float, default=10.0, help="length of each run")
    et.add_argument("--every", type=float, default=60.0, help="seconds between moves")
    et.add_argument("--standbys", type=int, default=1,
                    help="standbys started with the job (with --no-replenish: at least one "
                         "per move of the run)")
    et.add_argument("--no-replenish", action="store_true",
                    help="no new standby per move: start --standbys before the run instead "
                         "(on a small machine a standby's start-up shares the job's cores)")
    et.add_argument("--name", default="ettr", help="result file name")
    et.add_argument("--json", metavar="FILE", help="also write {\"results\": [...]} here")
    sg = _bench_parser(bsub, "straggler", "one worker slowed from a step on: detection "
                                          "latency and efficiency loss, trainmover vs "
                                          "restart-immediately vs defer")
    sg.add_argument("--steps", type=int, default=400,
                    help="steps per run (more than --onset + 100)")
    sg.add_argument("--onset", type=int, default=60, help="the step the slowdown starts")
    sg.add_argument("--factor", type=float, default=1.2, help="compute slowdown (1.2: 20%%)")
    sg.add_argument("--every", type=int, default=50, help="checkpoint interval (steps)")
    sg.add_argument("--json", metavar="FILE", help="also write {\"results\": [...]} here")
    vw = _bench_parser(bsub, "view", "what the dashboard and metrics cost the step, and how "
                                     "fast a running job's status answers")
    vw.add_argument("--steps", type=int, default=300,
                    help="steps per run (more than 25: the first 5 are warm-up, left out)")
    soak = bsub.add_parser("soak", help="a long job disrupted every ~20 s (crash, hang, "
                                        "migration, controller and standby kills), checked "
                                        "against the same job without events")
    soak.add_argument("--minutes", type=float, default=30.0,
                      help="about how long the job trains without events (its steps are "
                           "sized by a calibration run; at least 200 steps)")
    soak.add_argument("--interval", type=float, default=20.0, help="seconds between events")
    soak.add_argument("--seed", type=int, default=1,
                      help="seed of the driver's random choices: each event's kind, victim "
                           "and moment")
    soak.add_argument("--out", default="benchmarks/results",
                      help="directory of the result (soak.json and its report soak.md)")
    soak.set_defaults(fn=cmd_bench)
    hosts = bsub.add_parser("hosts", help="planned migration across hosts vs within a host "
                                          "(network namespaces: needs root)")
    hosts.add_argument("--repeats", type=int, default=3,
                       help="jobs run, each measuring a migration within a host and one "
                            "across hosts")
    hosts.add_argument("--out", default="benchmarks/results",
                       help="directory of the result (hosts.json and .md)")
    hosts.set_defaults(fn=cmd_bench)
    tft = _bench_parser(bsub, "torchft", "trainmover and torchft side by side: one "
                                         "data-parallel replica killed (needs torchft)")
    tft.add_argument("--replicas", type=int, default=4,
                     help="data-parallel replicas (must divide the recipe's batch)")
    tft.add_argument("--kill-after", type=int, default=30, help="steps at full width first")
    tft.add_argument("--steps-after", type=int, default=10,
                     help="steps at full width after the kill before a run ends")
    down = bsub.add_parser("downtime", help="planned migration vs naive migration vs restart")
    down.add_argument("--workers", default="4,8", help="comma list from 4, 8, 16")
    down.add_argument("--strategies", default="trainmover,trainmover_cold,naive,restart",
                      help="comma list of strategies from trainmover, trainmover_cold, naive, "
                           "restart (crash and hang run only trainmover and restart)")
    down.add_argument("--scenarios", default="planned,crash,hang",
                      help="planned (all strategies); crash, hang (trainmover, restart)")
    down.add_argument("--name", default="downtime", help="result file name under --out")
    down.add_argument("--no-compile", action="store_true", help="eager mode (faster, less real)")
    down.add_argument("--event-step", type=int, default=8,
                      help="the step at which the event is delivered (for trainmover, also "
                           "once its standby is warm)")
    down.add_argument("--repeats", type=int, default=3, help="runs per cell (median, min, max)")
    down.add_argument("--compile-up-to", type=int, default=8,
                      help="larger jobs run eager (16 compiled processes do not fit 2 cores)")
    down.add_argument("--json", help="also write the results JSON here")
    down.add_argument("--out", default="benchmarks/results",
                      help="directory of the result (NAME.json and NAME.md)")
    down.set_defaults(fn=cmd_bench)
    quick = bsub.add_parser("quick", help="the headline cells in minutes (make bench-quick): "
                                          "a planned migration, a crash recovery and a stop-"
                                          "and-restart from a checkpoint, eager, median of "
                                          "--repeats (bench downtime's jobs and files)")
    quick.add_argument("--workers", type=int, default=4, help="job size: 4, 8 or 16")
    quick.add_argument("--repeats", type=int, default=3, help="runs per cell (median, min, max)")
    quick.add_argument("--event-step", type=int, default=8,
                       help="the step at which each event is delivered (for the trainmover "
                            "cells, also once the standby is warm)")
    quick.add_argument("--name", default="quick", help="result file name under --out")
    quick.add_argument("--out", default="benchmarks/results",
                       help="directory of the result (NAME.json and NAME.md)")
    quick.set_defaults(fn=cmd_bench)
    ss = bsub.add_parser("state-size", help="planned migration and crash recovery from a "
                                            "data-parallel replica against the state a "
                                            "worker holds (DP2 + one standby, built-in "
                                            "trainer sized per --sizes): downtime, bytes, "
                                            "point-to-point bandwidth, peak RSS")
    ss.add_argument("--sizes", default="10,100,500,2000",
                    help="comma list of state sizes per worker in MB (10^6 bytes of fp32 "
                         "parameters and AdamW's two moments: 12 bytes a parameter)")
    ss.add_argument("--repeats", type=int, default=3,
                    help="runs of each scenario per size (median, min, max)")
    ss.add_argument("--scenarios", default="planned,crash",
                    help="comma list from planned (a migration to the warm standby), crash "
                         "(SIGKILL, recovered from the data-parallel replica)")
    ss.add_argument("--name", default="state_size", help="result file name under --out")
    ss.add_argument("--out", default="benchmarks/results",
                    help="directory of the result (NAME.json and NAME.md)")
    ss.set_defaults(fn=cmd_bench)
    return p


def parse_command_line(argv: list[str]) -> argparse.Namespace:
    """A launch's training command (after '--') and the --section.field[=value] settings of
    run, launch and config (``args.overrides``) apart, the rest by the parser."""
    command: list[str] = []
    if argv[:1] == ["launch"] and "--" in argv:
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1:]
    argv, overrides = split_overrides(argv) if argv[:1] in (["run"], ["launch"], ["config"]) \
        else (argv, [])
    args = make_parser().parse_args(argv)
    args.overrides = overrides
    if command:
        args.command = command
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_command_line(list(sys.argv[1:] if argv is None else argv))
    try:
        return args.fn(args)
    except ValueError as exc:
        print(f"trainmover: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # JobFailed and worker errors: the job stopped, say why
        print(f"trainmover: job failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("trainmover: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
