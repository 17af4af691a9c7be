"""``trainmover`` command line: run, demo, bench. Kept small: recipes carry the settings."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from .config import JobConfig
from .recipes import RECIPES, get_recipe
from .topology import Layout


def build_config(args: argparse.Namespace) -> JobConfig:
    """Recipe + command-line overrides, fully validated (raises ValueError naming the value)."""
    cfg = get_recipe(args.recipe)
    if any(v is not None for v in (args.dp, args.pp, args.tp)):
        cfg.layout = Layout(args.dp if args.dp is not None else cfg.layout.dp,
                            args.pp if args.pp is not None else cfg.layout.pp,
                            args.tp if args.tp is not None else cfg.layout.tp)
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
    if args.device is not None:
        cfg.runtime.device = args.device
    cfg.validate()
    if args.workers is not None and args.workers != cfg.layout.num_roles:
        raise ValueError(f"--workers={args.workers} does not match layout {cfg.layout} "
                         f"(dp*pp*tp = {cfg.layout.num_roles})")
    return cfg


def _job_args(p: argparse.ArgumentParser, default_recipe: str) -> None:
    p.add_argument("--recipe", default=default_recipe,
                   help=f"named recipe ({', '.join(sorted(RECIPES))})")
    p.add_argument("--dp", type=int)
    p.add_argument("--pp", type=int)
    p.add_argument("--tp", type=int)
    p.add_argument("--workers", type=int, help="expected worker count (checked against dp*pp*tp)")
    p.add_argument("--steps", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--compile", action="store_true", help="torch.compile each stage module")
    p.add_argument("--data", help="text file (bytes as tokens) or uint16 token file")
    p.add_argument("--data-format", choices=["text", "uint16"])
    p.add_argument("--device", choices=["cpu", "cuda"])
    p.add_argument("--run-dir", help="output directory (default: runs/<recipe>-<time>)")
    p.add_argument("--quiet", action="store_true")


def _default_run_dir(name: str) -> str:
    return os.path.join("runs", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")


def cmd_run(args: argparse.Namespace) -> int:
    from .launcher import run_job

    cfg = build_config(args)
    run_dir = args.run_dir or _default_run_dir(cfg.name)
    summary = run_job(cfg, run_dir, quiet=args.quiet)
    print(json.dumps(summary, indent=2))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .launcher import run_job

    cfg = build_config(args)
    run_dir = args.run_dir or _default_run_dir("demo")
    summary = run_job(cfg, run_dir, quiet=args.quiet)
    print()
    print(f"demo finished: {summary['steps']} steps on {cfg.layout} "
          f"({summary['workers']} workers), final loss {summary['final_loss']:.4f}")
    if summary["mean_step_time_s"]:
        print(f"  mean step time   {summary['mean_step_time_s'] * 1000:.1f} ms")
    print(f"  weights sha256   {summary['weights_sha256']}")
    print(f"  run dir          {os.path.abspath(run_dir)}  (metrics.jsonl, events.jsonl, "
          f"summary.json, final/checkpoint)")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from . import bench

    return bench.main(args)


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trainmover",
                                description="Keep distributed PyTorch training running through "
                                            "interruptions.")
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a local job")
    _job_args(run, "demo")
    run.set_defaults(fn=cmd_run)
    demo = sub.add_parser("demo", help="a small multi-worker job on the built-in corpus")
    _job_args(demo, "demo")
    demo.set_defaults(fn=cmd_demo)
    bench = sub.add_parser("bench", help="benchmarks (results under benchmarks/results/)")
    bsub = bench.add_subparsers(dest="bench", required=True)
    step = bsub.add_parser("step", help="engine step time vs DistributedDataParallel (DP only)")
    step.add_argument("--recipe", default="bench_step")
    step.add_argument("--dp", type=int, default=2)
    step.add_argument("--steps", type=int, default=30)
    step.add_argument("--repeats", type=int, default=3)
    step.add_argument("--out", default="benchmarks/results")
    step.set_defaults(fn=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
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
