"""Reference pages generated from the code when the documentation is built, so they cannot
drift from it: nothing generated is committed.

- ``cli_markdown()``: every subcommand and argument of ``trainmover`` (the argparse parser of
  ``trainmover/cli/``, walked: name, flags, type or choices, default, help).
- ``config_markdown()``: every setting of a ``JobConfig`` (section, name, type, default, and
  its doc as ``core/config_file.py``'s ``field_doc_sources`` finds it, the same as in a job
  file written by ``trainmover config``: the ``#`` comment above or beside the field, its
  ``name``: entry in the section's docstring, a comment block shared with other fields that
  names it, or a docstring sentence that names it).
- ``benchmarks_markdown(results_dir)``: one entry per ``benchmarks/results/*.json``, its
  tables rendered by the bench that wrote the file, with the file's commit, machine and the
  command that writes it.

This file is also the MkDocs hook (``hooks:`` in ``mkdocs.yml``): ``on_files`` adds the three
pages under ``reference/`` and the committed result reports under ``results/``;
``on_page_markdown`` fills ``{{ default: section.field }}`` markers in hand-written pages with
the setting's default (an unknown setting fails the build). Importing it needs neither torch
nor mkdocs.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from trainmover.core.config_file import class_doc, field_doc_sources

ROOT = Path(__file__).resolve().parent.parent

# ----------------------------------------------------------------------------------------
# The command line
# ----------------------------------------------------------------------------------------


@dataclass
class CliArgument:
    command: str            # "trainmover run", "trainmover bench downtime"
    name: str               # "--checkpoint-every", or a positional's metavar
    flags: list[str]        # every option string ([] for a positional)
    value: str              # "N", "one of: off, alert, migrate", "flag"
    default: str            # "" when there is none
    help: str
    required: bool


@dataclass
class CliCommand:
    name: str               # "trainmover run"
    help: str
    description: str
    usage: str
    arguments: list[CliArgument] = field(default_factory=list)


def _make_parser() -> argparse.ArgumentParser:
    from trainmover.cli import make_parser

    return make_parser()


def _value_of(action: argparse.Action) -> str:
    if action.nargs == 0:
        return "flag"
    if action.choices is not None:
        return "one of: " + ", ".join(str(c) for c in action.choices)
    if action.metavar:
        return str(action.metavar) if isinstance(action.metavar, str) else " ".join(action.metavar)
    kind = getattr(action.type, "__name__", None)
    if kind in (None, "str"):
        return "text"
    if kind == "<lambda>":
        return "value"
    return {"int": "integer", "float": "number"}.get(kind, kind)


def _default_of(action: argparse.Action) -> str:
    default = action.default
    if default is None or default is argparse.SUPPRESS or action.nargs == 0:
        return ""
    if isinstance(default, (list, tuple)):
        return ",".join(str(d) for d in default)
    return str(default)


def _expanded_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if not action.help or action.help is argparse.SUPPRESS:
        return ""
    return " ".join(parser._get_formatter()._expand_help(action).split())


def cli_commands(parser: argparse.ArgumentParser | None = None) -> list[CliCommand]:
    """Every command reachable from ``parser`` (depth first, as the parser lists them), each
    with its arguments; the root command first."""
    parser = parser or _make_parser()
    out: list[CliCommand] = []

    def walk(p: argparse.ArgumentParser, name: str, help_text: str) -> None:
        cmd = CliCommand(name=name, help=help_text, description=" ".join((p.description or "")
                                                                         .split()),
                         usage=" ".join(p.format_usage().split()).removeprefix("usage: "))
        out.append(cmd)
        children = []
        for action in p._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            if isinstance(action, argparse._SubParsersAction):
                helps = {a.dest: a.help or "" for a in action._choices_actions}
                seen = set()
                for sub_name, sub in action.choices.items():
                    if id(sub) in seen:      # an alias of one already listed
                        continue
                    seen.add(id(sub))
                    children.append((sub, f"{name} {sub_name}", helps.get(sub_name, "")))
                continue
            flags = list(action.option_strings)
            label = max(flags, key=len) if flags else (action.metavar or action.dest)
            cmd.arguments.append(CliArgument(
                command=name, name=str(label), flags=flags, value=_value_of(action),
                default=_default_of(action), help=_expanded_help(p, action),
                required=bool(action.required)))
        for sub, sub_name, sub_help in children:
            walk(sub, sub_name, sub_help)

    walk(parser, parser.prog, " ".join((parser.description or "").split()))
    return out


_CODE_SPAN = re.compile(r"(`+)(.+?)\1")


def _cell(text: str) -> str:
    """``text`` on one line for a table cell: outside code spans, ``|`` escaped and ``<``,
    ``>`` as entities (``<run dir>`` is no HTML tag); code spans as they are."""
    text = " ".join(str(text).split())
    out, pos = [], 0
    for m in _CODE_SPAN.finditer(text):
        out.append(_plain(text[pos:m.start()]))
        out.append(m.group(0))
        pos = m.end()
    out.append(_plain(text[pos:]))
    return "".join(out)


def _code(text: str) -> str:
    """``text`` for inside a code span of a table cell (one line, no backtick)."""
    return " ".join(str(text).split()).replace("`", "'")


def _plain(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def _anchor(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def cli_markdown(parser: argparse.ArgumentParser | None = None) -> str:
    commands = cli_commands(parser)
    lines = ["# Command line reference", "",
             "Generated from the parser in `trainmover/cli/` when these pages are built: "
             "every command and every argument, with its default and help text. "
             "`trainmover launch` takes the training command after `--` "
             "(`python SCRIPT ARGS` or `python -m MODULE ARGS`).", ""]
    lines += [f"- [`{c.name}`](#{_anchor(c.name)}): {_cell(c.help)}" for c in commands[1:]]
    for c in commands:
        lines += ["", f"## {c.name} {{#{_anchor(c.name)}}}", ""]
        if c.help:
            text = _cell(c.help)
            lines += [text[:1].upper() + text[1:] + ("" if text.endswith(".") else "."), ""]
        if c.description and c.description != c.help:
            lines += [_cell(c.description), ""]
        lines += ["```text", c.usage, "```", ""]
        if not c.arguments:
            continue
        lines += ["| argument | value | default | description |", "|---|---|---|---|"]
        for a in c.arguments:
            names = ", ".join(f"`{f}`" for f in a.flags) if a.flags else f"`{a.name}`"
            if a.required:
                names += " (required)"
            lines.append(f"| {names} | {_cell(a.value)} | "
                         f"{'`' + _code(a.default) + '`' if a.default else ''} | "
                         f"{_cell(a.help)} |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------
# The configuration
# ----------------------------------------------------------------------------------------


@dataclass
class Setting:
    section: str            # "checkpoint", or "job" for JobConfig's own fields
    name: str
    type: str
    default: object
    doc: str
    doc_source: str         # "comment", "docstring", "shared comment", "docstring mention", ""

    @property
    def key(self) -> str:
        return self.name if self.section == "job" else f"{self.section}.{self.name}"


# name -> (doc, where it came from) for each field of a dataclass: the job files' extractor
# (``core/config_file.py``), the one implementation, so that these pages and a job file
# written by `trainmover config` document each field alike.
field_docs = field_doc_sources


def _type_name(f: dataclasses.Field) -> str:
    t = f.type
    if not isinstance(t, str):
        t = getattr(t, "__name__", str(t))
    return t


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def config_sections() -> list[tuple[str, type]]:
    """(section name, dataclass) for every section of ``JobConfig``, in its order, with
    ``("job", JobConfig)`` first for its own fields."""
    from trainmover.core.config import JobConfig

    out = [("job", JobConfig)]
    for f in dataclasses.fields(JobConfig):
        default = _default(f)
        if dataclasses.is_dataclass(default):
            out.append((f.name, type(default)))
    return out


def config_settings() -> list[Setting]:
    out = []
    for section, cls in config_sections():
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            default = _default(f)
            if section == "job" and dataclasses.is_dataclass(default):
                continue
            text, source = docs.get(f.name, ("", ""))
            out.append(Setting(section, f.name, _type_name(f), default, text, source))
    return out


@functools.lru_cache(maxsize=1)
def _defaults() -> dict[str, str]:
    return {s.key: _show_default(s.default) for s in config_settings()}


def setting_default(key: str) -> str:
    """``section.field``'s default as the reference shows it (``KeyError`` if unknown)."""
    try:
        return _defaults()[key]
    except KeyError:
        raise KeyError(f"no setting {key!r} in JobConfig") from None


def _show_default(value) -> str:
    return json.dumps(value)


def _class_doc(cls) -> str:
    return " ".join(class_doc(cls).split())


def config_markdown() -> str:
    settings = config_settings()
    lines = ["# Configuration reference", "",
             "Generated from the dataclasses in `trainmover/core/config.py` (and `Layout` in "
             "`trainmover/core/topology.py`) when these pages are built: every setting of a "
             "job, by section, with its type, default and documentation. A job's settings are "
             "saved as the run dir's `job.json`, one object per section. In Python, set a "
             "field (`cfg.health.heartbeat_timeout_s = 2.0`) or name it `<section>_<field>` "
             "in `cfg.override(...)`. See [Configuration](../configuration.md) for how recipes, "
             "flags and these settings combine.", ""]
    sections = config_sections()
    lines.append("Sections: " + ", ".join(f"[`{name}`](#{name})" for name, _ in sections) + ".")
    for name, cls in sections:
        lines += ["", f"## {name} {{#{name}}}", ""]
        if name == "job":
            lines += ["The fields of `JobConfig` itself (top level of `job.json`).", ""]
        lines += [_cell(_class_doc(cls)) or f"`{cls.__name__}`.", "",
                  f"Class: `{cls.__module__}.{cls.__name__}`.", "",
                  "| setting | type | default | description |", "|---|---|---|---|"]
        for s in (s for s in settings if s.section == name):
            lines.append(f"| `{s.key}` | `{_code(s.type)}` | `{_code(_show_default(s.default))}` "
                         f"| {_cell(s.doc)} |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------
# Benchmark results
# ----------------------------------------------------------------------------------------

# Groups of the benchmarks page, in order: (title, file stems). A result file not listed
# here still appears, under "Other results".
BENCH_GROUPS = [
    ("Downtime: planned migration, crash, hang", [
        "quick", "downtime-eager", "downtime-failures-eager", "downtime-compiled",
        "downtime-failures-compiled", "downtime", "downtime-failures",
        "downtime-before-after", "downtime-crash-before-after",
        "control-4w-downtime-before-after", "control-8w-downtime-before-after",
        "control-16w-downtime-before-after", "state_size",
        "state_size_inplace", "state_size_precopy", "state_size_precopy_2gb"]),
    ("Against torchft", ["torchft"]),
    ("Recovery sources and checkpoint cost", ["recovery_sources", "striped_recovery",
                                              "checkpoint_cost"]),
    ("Cost per step", [
        "step", "example_overhead", "example_overhead_torch_ddp", "example_overhead_torch_fsdp",
        "example_overhead_torch_fsdp-before-future-wait", "example_overhead_torch_fsdp_tp",
        "example_overhead_torch_pipeline", "control_cpu", "vote_cost", "vote_hosts_store",
        "vote_hosts", "vote_hosts_one_write", "vote_groups", "vote_groups_relay",
        "vote_groups_spread", "store_latency", "store_big_get",
        "store_step_before_after", "control_step_before_after"]),
    ("torch examples' downtime", ["example_downtime_torch_fsdp_tp"]),
    ("Stragglers and rolling maintenance", [
        "straggler", "straggler_false_positives", "straggler_results", "ettr_10min", "ettr",
        "ettr_prestarted", "ettr_results"]),
    ("Hosts, scale and endurance", [
        "hosts", "store_etcd", "etcd_vote", "etcd_vote_small", "control", "control_1k_4k",
        "control_store_fixes", "control_groups", "control_groups_flat",
        "control_hostbeats",
        "control_flat",
        "control_scaling",
        "control_4096", "report-fencing-before-after", "projection", "projection-quick",
        "store_keys", "soak",
        "soak_c988399_failed", "view"]),
]


def _bench_renderer(stem: str, r: dict):
    """(command that writes the file, function rendering it as the bench does, or None)."""
    def mod(name):
        return importlib.import_module(f"trainmover.bench.{name}")

    kind = r.get("benchmark")
    if kind == "downtime" or stem.startswith("downtime") and "cells" in r and "trees" not in r:
        return "trainmover bench downtime", lambda r: mod("downtime").downtime_table(r)
    if stem.endswith("before-after"):
        return "python benchmarks/compare_downtime.py", None
    if kind == "checkpoint":
        return "trainmover bench checkpoint", lambda r: mod("checkpoint")._table(
            r, sorted(int(k) for k in r["cells"]))
    if kind == "example":
        return "trainmover bench example", lambda r: mod("example")._table(r)
    if kind == "example_downtime":
        return "trainmover bench example-downtime", lambda r: mod("example_downtime")._table(r)
    if kind == "state_size":
        return "trainmover bench state-size", lambda r: mod("state_size").state_size_table(r)
    if kind == "projection":
        return "trainmover project", lambda r: mod("project")._table(r)
    if list(r) == ["results"]:
        return None, None          # a `--json FILE` extract
    table = {
        "ettr": ("trainmover bench ettr", lambda r: mod("ettr")._table(r)),
        "hosts": ("trainmover bench hosts", lambda r: mod("hosts")._hosts_table(r)),
        "recovery_sources": ("trainmover bench sources", lambda r: mod("sources")._table(r)),
        "straggler": ("trainmover bench straggler", lambda r: mod("stragglers")._table(r)),
        "torchft": ("trainmover bench torchft", lambda r: mod("torchft_side")._table(r)),
        "view": ("trainmover bench view", lambda r: mod("view")._table(r)),
        "control": ("trainmover bench control", lambda r: mod("control").control_table(r)),
        "straggler_false_positives": ("trainmover bench false-positives", None),
        "soak": ("trainmover bench soak", None),
        "step": ("trainmover bench step", None),
        "store_keys": ("python benchmarks/store_keys.py", None),
        "control_cpu": ("python benchmarks/control_cpu.py", None),
        "striped_recovery": ("python benchmarks/striped_recovery.py", None),
        "store_etcd": ("python benchmarks/store_etcd.py", None),
    }
    for prefix in sorted(table, key=len, reverse=True):   # the longest name that fits
        if stem == prefix or stem.startswith(prefix + "_"):
            return table[prefix]
    return None, None


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict) and set(v) >= {"median", "min", "max"}:
        return f"{_fmt(v['median'])} ({_fmt(v['min'])} to {_fmt(v['max'])})"
    if isinstance(v, (list, dict)):
        v = json.dumps(v)
    v = str(v)
    return v if len(v) <= 80 else v[:77] + "..."


def _is_spread(v) -> bool:
    return isinstance(v, dict) and {"median", "min", "max"} <= set(v)


def _flatten(row: dict, prefix: str = "") -> dict:
    """A record's scalar values (and median/min/max spreads) by dotted column name."""
    out = {}
    for k, v in row.items():
        name = f"{prefix}{k}"
        if _is_spread(v) or not isinstance(v, (list, dict)):
            out[name] = v
        elif isinstance(v, list) and all(not isinstance(x, (list, dict)) for x in v):
            out[name] = ", ".join(str(x) for x in v) or "-"
        elif isinstance(v, dict):
            out.update(_flatten(v, name + "."))
    return out


def _generic(r: dict, max_rows: int = 25, max_cols: int = 12) -> str:
    """A result of no known shape: its scalar settings, then each list (or mapping) of
    records as a table of their scalar values."""
    skip = {"commit", "machine", "scratch", "command"}
    scalars = [(k, v) for k, v in r.items() if k not in skip
               and not isinstance(v, (list, dict))]
    lines = []
    if scalars:
        lines += ["| field | value |", "|---|---|"]
        lines += [f"| {_cell(k)} | {_cell(_fmt(v))} |" for k, v in scalars]
        lines.append("")
    for key, value in r.items():
        rows = value if isinstance(value, list) else None
        if isinstance(value, dict) and value and all(isinstance(v, dict) and not _is_spread(v)
                                                     for v in value.values()):
            rows = [{"": k, **v} for k, v in value.items()]
        if not rows or not all(isinstance(x, dict) for x in rows):
            continue
        flat = [_flatten(x) for x in rows]
        cols = list(dict.fromkeys(c for x in flat for c in x))
        if not cols:
            continue
        more = len(cols) - max_cols
        cols = cols[:max_cols]
        lines += [f"`{key}`" + (f" (the first {max_cols} of {len(cols) + more} columns)"
                                if more > 0 else "") + ":", "",
                  "| " + " | ".join(_cell(c) for c in cols) + " |", "|" + "---|" * len(cols)]
        for row in flat[:max_rows]:
            lines.append("| " + " | ".join(_cell(_fmt(row.get(c, ""))) for c in cols) + " |")
        if len(rows) > max_rows:
            lines += ["", f"({len(rows) - max_rows} more rows in the file.)"]
        lines.append("")
    return "\n".join(lines)


def _tables_only(md: str) -> str:
    """The pipe tables of a rendered report, without its prose."""
    out, in_table = [], False
    for line in md.splitlines():
        if line.startswith("|"):
            out.append(line)
            in_table = True
        elif in_table:
            out.append("")
            in_table = False
    return "\n".join(out)


def _demote(md: str, title_level: int) -> tuple[str, str]:
    """(title, body): the report's first heading taken out as its title, the other headings
    moved below ``title_level``."""
    title, body, fenced = "", [], False
    for line in md.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"(#+)\s+(.*)", line)
        if m and not title and not body:
            title = m.group(2)
            continue
        if m:
            line = "#" * (title_level + len(m.group(1))) + " " + m.group(2)
        body.append(line)
    return title, "\n".join(body).strip()


def _result_entry(path: Path, link_prefix: str) -> list[str]:
    stem = path.stem
    r = json.loads(path.read_text())
    md_path = path.with_suffix(".md")
    command, render = _bench_renderer(stem, r)
    rendered, how = "", ""
    if render is not None:
        try:
            rendered = render(r)
        except Exception as exc:  # an older file the bench's current table cannot read
            how = (f"The bench's current table does not read this older file "
                   f"({type(exc).__name__}: {exc}); shown as recorded.")
    committed = md_path.read_text() if md_path.exists() else None
    title = ""
    if rendered:
        if committed is not None and rendered.strip() != committed.strip():
            title, _ = _demote(committed, 3)
            body = _tables_only(rendered)
            how = ("Tables only, as the bench's current code renders this file: its text "
                   "differs from the committed report's, which holds the text that goes with "
                   "them.")
        else:
            title, body = _demote(rendered, 3)
    else:
        if committed is not None:
            title, _ = _demote(committed, 3)
        body = _generic(r)
    machine = r.get("machine") or {}
    facts = [f"File: `benchmarks/results/{path.name}`"]
    if md_path.exists():
        facts[0] += f" (report: [{md_path.name}]({link_prefix}{md_path.name}))"
    facts.append(f"commit: `{r['commit']}`" if r.get("commit")
                 else "commit: not recorded in the file")
    recorded = r.get("command")
    if isinstance(recorded, list):
        recorded = " ".join(str(a) for a in recorded)
    if recorded:
        facts.append(f"command: `{recorded}`")
    elif command:
        facts.append(f"written by `{command}` (the exact command line is not recorded in "
                     f"the file)")
    else:
        facts.append("command: not recorded in the file")
    if isinstance(machine, dict) and machine:
        facts.append("machine: " + ", ".join(
            {"cores": f"{machine[k]} cores", "torch": f"torch {machine[k]}"}.get(k, str(machine[k]))
            for k in ("cpu", "cores", "torch") if machine.get(k)))
    elif machine:
        facts.append(f"machine: {machine}")
    lines = [f"### {stem} {{#{_anchor(stem)}}}", ""]
    if title:
        lines += [f"*{title.strip()}*", ""]
    lines += ["; ".join(facts) + ".", ""]
    if how:
        lines += [how, ""]
    lines += [body, ""]
    return lines


def benchmarks_markdown(results_dir: Path | None = None, link_prefix: str = "../results/") -> str:
    results_dir = Path(results_dir or ROOT / "benchmarks" / "results")
    jsons = {p.stem: p for p in sorted(results_dir.glob("*.json"))}
    mds = sorted(p for p in results_dir.glob("*.md") if p.stem not in jsons)
    lines = ["# Benchmark results", "",
             "Generated from `benchmarks/results/*.json` when these pages are built: each "
             "file's tables as the bench that wrote it renders them, with the commit, the "
             "machine and the command recorded in the file (or a note where the file does not "
             "record them). What each bench measures and how to read it: "
             "[Benchmarks](../benchmarks.md).", ""]
    listed = set()
    groups = [(t, [s for s in stems if s in jsons]) for t, stems in BENCH_GROUPS]
    rest = [s for s in jsons if not any(s in stems for _, stems in BENCH_GROUPS)]
    if rest:
        groups.append(("Other results", rest))
    for title, stems in groups:
        if not stems:
            continue
        lines += [f"## {title}", ""]
        for stem in stems:
            listed.add(stem)
            lines += _result_entry(jsons[stem], link_prefix)
    if mds:
        lines += ["## Reports without a JSON file", ""]
        lines += [f"- [{p.name}]({link_prefix}{p.name}): {_demote(p.read_text(), 3)[0]}"
                  for p in mds]
        lines.append("")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------
# The MkDocs hook
# ----------------------------------------------------------------------------------------

GENERATED = {"reference/cli.md": lambda results: cli_markdown(),
             "reference/config.md": lambda results: config_markdown(),
             "reference/benchmark-results.md": benchmarks_markdown}
DEFAULT_MARK = re.compile(r"\{\{\s*default:\s*([\w.]+)\s*\}\}")


def on_files(files, config):
    from mkdocs.structure.files import File

    _defaults.cache_clear()   # read afresh at each build
    results = Path(config["config_file_path"]).parent / "benchmarks" / "results"
    for uri, make in GENERATED.items():
        files.append(File.generated(config, uri, content=make(results)))
    # the committed benchmark reports (and their images), linked from the pages
    for path in sorted(results.iterdir()):
        if path.suffix in (".md", ".png"):
            files.append(File.generated(config, f"results/{path.name}", abs_src_path=str(path)))
    return files


def on_page_markdown(markdown, page, config, files):
    def default(m):
        return f"`{setting_default(m.group(1))}`"

    return DEFAULT_MARK.sub(default, markdown)
