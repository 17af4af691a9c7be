"""``trainmover config``: a job's configuration as a complete TOML job file, for ``run
--config`` (``core/config_file.py``, ``docs/config-files.md``); and the ``--config`` flag of
``run`` and ``launch``."""
from __future__ import annotations

import argparse
import sys

from trainmover.core.config_file import apply_job_file, apply_overrides
from trainmover.recipes import RECIPES, get_recipe

OVERRIDES_HELP = ("then --SECTION.FIELD=VALUE (or --SECTION.FIELD VALUE) sets any field of "
                  "the job, after every other flag, e.g. --train.lr=1e-3 --model.n_layers=8 "
                  "(docs/config-files.md)")


def add_config_flag(p: argparse.ArgumentParser, base: str) -> None:
    p.add_argument("--config", metavar="FILE",
                   help=f"a TOML job file, one [section] per part of the job (`trainmover "
                        f"config` prints a complete one): it sets the fields it names over "
                        f"{base}, and the other flags override it; {OVERRIDES_HELP}")


def add_config_parser(sub) -> None:
    p = sub.add_parser("config", help="print a recipe (or a job file, with overrides) as a "
                                      "complete, commented TOML job file for --config",
                       description="Prints every section and field of the job, each with its "
                                   "doc; `trainmover run --config FILE` runs it.")
    p.add_argument("--recipe", default="demo",
                   help=f"named recipe ({', '.join(sorted(RECIPES))}; default demo)")
    add_config_flag(p, "the recipe")
    p.set_defaults(fn=cmd_config)


def cmd_config(args: argparse.Namespace) -> int:
    from trainmover.core.config_file import to_toml

    cfg = get_recipe(args.recipe)
    if args.config:
        apply_job_file(cfg, args.config)
    apply_overrides(cfg, getattr(args, "overrides", []))
    cfg.validate()
    source = f"recipe {args.recipe!r}" + (f" with {args.config!r}" if args.config else "")
    sys.stdout.write(to_toml(cfg, f"trainmover job file: {source}. Run it with `trainmover run "
                                  f"--config FILE`; --SECTION.FIELD=VALUE overrides a field. "
                                  f'TOML has no null: "none" leaves an optional field unset.'))
    return 0
