"""``trainmover`` command line: run, demo, bench. Kept small: recipes carry the settings.

The parser is assembled here from the modules that hold each command's flags and handler:
``jobs.py`` (the commands that run a job's processes), ``flags.py`` (the flags that define a
job and the ``JobConfig`` they build), ``config.py`` (``trainmover config`` and ``--config``),
``ops.py`` (the operator's commands on a job) and ``bench.py`` (``bench``, ``project``)."""
from __future__ import annotations

import argparse
import sys

from trainmover.cli import bench, jobs, ops
from trainmover.cli.config import add_config_parser
from trainmover.cli.flags import (apply_worker_faults, build_config, build_launch_config,
                                  python_command)
from trainmover.cli.jobs import agent_settings
from trainmover.core.config_file import split_overrides
from trainmover.core.proc import exit_now

__all__ = ["agent_settings", "apply_worker_faults", "build_config", "build_launch_config",
           "console_main", "main", "make_parser", "parse_command_line", "python_command"]

# each adds one command; in the order `trainmover --help` lists them
COMMANDS = (jobs.add_run_parser, jobs.add_launch_parser, add_config_parser,
            jobs.add_demo_parser, jobs.add_controller_parser, ops.add_migrate_parser,
            ops.add_status_parser, ops.add_drain_parser, ops.add_dashboard_parser,
            ops.add_report_parser, bench.add_project_parser, ops.add_stop_parser,
            jobs.add_agent_parser, bench.add_bench_parser)


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trainmover",
                                description="Keep distributed PyTorch training running through "
                                            "interruptions.")
    sub = p.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(sub)
    return p


def parse_command_line(argv: list[str]) -> argparse.Namespace:
    """A launch's training command (after '--') and the --section.field[=value] settings of
    run, launch, config and bench control (the simulated job's: ``args.overrides``) apart,
    the rest by the parser."""
    command: list[str] = []
    if argv[:1] == ["launch"] and "--" in argv:
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1:]
    takes = argv[:1] in (["run"], ["launch"], ["config"]) or argv[:2] == ["bench", "control"]
    argv, overrides = split_overrides(argv) if takes else (argv, [])
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


# Commands that control a job (or serve a host of it) to its end: when they return, the job's
# processes have exited and every file, event and summary is written, so the process ends
# without freeing its modules (``exit_now``), which held the shell's prompt back.
FAST_EXIT = ("run", "launch", "controller", "demo", "agent")


def console_main() -> None:
    """The ``trainmover`` command (and ``python -m trainmover``): ``main`` as a process."""
    argv = sys.argv[1:]
    code = main(argv)
    if argv[:1] and argv[0] in FAST_EXIT:
        exit_now(code)
    sys.exit(code)
