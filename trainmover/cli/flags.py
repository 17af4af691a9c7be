"""The flags that define a job (``run``, ``demo``, ``launch``) and the ``JobConfig`` they
build: recipe or training command, then the ``--config`` job file, the flags and the
``--section.field`` overrides."""
from __future__ import annotations

import argparse
import os
import sys

from trainmover.core.config import JobConfig
from trainmover.core.config_file import apply_job_file, apply_overrides
from trainmover.core.topology import Layout
from trainmover.recipes import RECIPES, get_recipe


# the runtime flags of run, demo and launch -> the setting each overrides (JobConfig.override)
RUNTIME_FLAGS = {"device": "process_device", "standbys": "standby_count",
                 "checkpoint_every": "checkpoint_every", "keep_checkpoints": "checkpoint_keep",
                 "snapshot_every": "snapshot_every", "precopy": "migration_precopy",
                 "stragglers": "straggler_policy",
                 "rebalance_every": "maintenance_rebalance_every_s",
                 "dashboard": "dashboard_port", "dashboard_host": "dashboard_host",
                 "controller_restart": "controller_restart", "verify_every": "health_verify_every",
                 "nnodes": "hosts_nnodes", "nproc_per_node": "hosts_nproc_per_node",
                 "store_host": "process_store_host", "store_port": "process_store_port",
                 "etcd": "process_etcd",
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


def add_job_args(p: argparse.ArgumentParser, default_recipe: str) -> None:
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
    add_runtime_args(p)
    p.add_argument("--run-dir", help="output directory (default: runs/<recipe>-<time>)")
    p.add_argument("--resume", metavar="RUN_DIR",
                   help="continue a stopped job from its newest intact checkpoint, with its "
                        "own settings")


def add_runtime_args(p: argparse.ArgumentParser) -> None:
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
    p.add_argument("--precopy", action="store_true", default=None,
                   help="a planned migration copies the leaver's state to the joiner in the "
                        "background and keeps it current by replaying the optimizer: the "
                        "switch moves little more than one step's gradients "
                        "(migration.precopy)")
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
    p.add_argument("--etcd", metavar="etcd://HOST:PORT,...?ca=F&cert=F&key=F",
                   help="keep the job's store on this etcd cluster (mutual TLS), so that it "
                        "outlives any one host, instead of host 0's built-in one")
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


# the flags that define a job: with --resume, the job's own settings (job.json) apply
JOB_FLAGS = ("dp", "pp", "tp", "nproc", "workers", "steps", "seed", "compile", "data",
             "data_format", "threads", "inject", "run_dir", "config", *RUNTIME_FLAGS)
