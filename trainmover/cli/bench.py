"""``trainmover bench`` (the benchmarks, run by ``trainmover.bench.main``) and ``trainmover
project`` (cluster-scale figures from their results)."""
from __future__ import annotations

import argparse


def cmd_bench(args: argparse.Namespace) -> int:
    from trainmover.bench.main import main

    return main(args)


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
    from trainmover.bench.scaling import control_from_bench, store_vote_from_file

    cluster = Cluster(**{f.name: getattr(args, f.name) for f in fields(Cluster)
                         if getattr(args, f.name) is not None})
    cluster.validate()
    if args.vote_hosts and not args.control:
        raise ValueError(f"--vote-hosts {args.vote_hosts!r} needs --control (a `trainmover "
                         f"bench control` result): it bounds that result's step overhead")
    costs = costs_from_bench(args.bench)
    control = control_from_bench(args.control) if args.control else None
    if args.vote_hosts:
        control.store_vote_s, control.store_vote_source = store_vote_from_file(args.vote_hosts)
    write_projection(cluster, costs, args.out, args.name, control)
    return 0


def add_project_parser(sub) -> None:
    from dataclasses import fields

    from trainmover.bench.project import Cluster

    p = sub.add_parser("project", help="ETTR and GPU-hours lost per week at 1K-128K GPUs, "
                                       "from measured per-event costs (a model)")
    p.add_argument("--bench", action="append", required=True, metavar="FILE",
                   help="a `trainmover bench downtime` or `bench quick` result (a planned "
                        "migration and a crash recovery at least; give several files to "
                        "combine them)")
    p.add_argument("--control", metavar="FILE",
                   help="a `trainmover bench control` result at two sizes or more: the "
                        "control plane's step overhead and crash path fitted against N and "
                        "counted (without it they stay at their small-job cost)")
    p.add_argument("--vote-hosts", metavar="FILE",
                   help="a `benchmarks/vote_hosts.py` result (with --control): one more "
                        "column, each step charged the store's measured share of the vote "
                        "alone, the other bound to the simulator's step overhead")
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


def add_bench_parser(sub) -> None:
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
    ss.add_argument("--strategies", default="stop_and_copy,precopy",
                    help="comma list of planned-migration strategies from stop_and_copy (the "
                         "whole state at the switch), precopy (migration.precopy: moved "
                         "during phase 1, kept current by replaying the optimizer)")
    ss.add_argument("--name", default="state_size", help="result file name under --out")
    ss.add_argument("--out", default="benchmarks/results",
                    help="directory of the result (NAME.json and NAME.md)")
    ss.set_defaults(fn=cmd_bench)
    xfer = bsub.add_parser("transfer", help="the state transfer of a migration or a replica "
                                            "recovery against the link it runs on, outside a "
                                            "job: the built-in trainer's state per --sizes, "
                                            "sent whole and as one buffer over one gloo pair")
    xfer.add_argument("--sizes", default="100,500,2000",
                      help="comma list of state sizes per worker in MB (as bench state-size)")
    xfer.add_argument("--repeats", type=int, default=5,
                      help="transfers per size (median, min, max; at least 3)")
    xfer.add_argument("--name", default="transfer", help="result file name under --out")
    xfer.add_argument("--out", default="benchmarks/results",
                      help="directory of the result (NAME.json and NAME.md)")
    xfer.set_defaults(fn=cmd_bench)
    ctl = bsub.add_parser("control", help="the control plane against the number of workers: "
                                          "simulated hosts of 8 workers on the real store, "
                                          "agents, worker control code and controller; step "
                                          "overhead, store load, controller round, a crash")
    ctl.add_argument("--workers", default="256,1024,4096",
                     help="comma list of job sizes (multiples of 8: hosts of 8 workers, "
                          "DP x PP8 x TP8 from 128 on)")
    ctl.add_argument("--repeats", type=int, default=3,
                     help="runs of each size, interleaved (median, min, max)")
    ctl.add_argument("--compute-s", type=float, default=0.2,
                     help="a simulated step's compute (seconds)")
    ctl.add_argument("--steady", type=int, default=10,
                     help="steps measured after the warm-up, before the crash")
    ctl.add_argument("--standbys", type=int, default=2, help="standby workers of the job")
    ctl.add_argument("--full-hosts", type=int, default=4,
                     help="hosts simulated whole (their workers' channels, beats and votes; "
                          "with the reporter's and the crashed worker's): the others are "
                          "light, their agents relaying their workers' votes and beats "
                          "themselves (the root store and controller see the same); 0: all")
    ctl.add_argument("--sim-procs", type=int, default=1,
                     help="processes the simulated hosts are shared among (each one core's "
                          "worth at most: past ~2K workers one saturates)")
    ctl.add_argument("--timeout-s", type=float, default=600.0,
                     help="the most one simulated job may take")
    ctl.add_argument("--keep", action="store_true",
                     help="keep the simulated jobs' run dirs (their events, logs and the "
                          "simulator's output; printed at the end), to look into a run")
    ctl.add_argument("--name", default="control", help="result file name under --out")
    ctl.add_argument("--out", default="benchmarks/results",
                     help="directory of the result (NAME.json and NAME.md)")
    ctl.set_defaults(fn=cmd_bench)
