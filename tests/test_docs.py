"""The documentation cannot drift from the code: every command line argument has a help text
and every setting a doc, both appear in the reference pages generated from the code
(``trainmover/docs_reference.py``), every benchmark result appears on the results page, and
the MkDocs site builds with ``--strict`` (no broken link, no missing page, no warning).
Light: no job runs."""
import argparse
import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from trainmover import docs_reference as ref
from trainmover.cli import make_parser
from trainmover.core.config import JobConfig

ROOT = Path(__file__).resolve().parent.parent


def _sections(markdown: str) -> dict[str, str]:
    """Level-2 heading (anchor attribute left out) -> the text under it."""
    out, name = {}, None
    for line in markdown.splitlines():
        m = re.match(r"## (.+?)(?: \{#[^}]*\})?$", line)
        if m:
            name = m.group(1)
            out[name] = ""
        elif name is not None:
            out[name] += line + "\n"
    return out


def _parser_arguments(parser: argparse.ArgumentParser, name: str, out: list) -> list:
    """(command, argument, help) for every argument of every command, walked here
    independently of the generator."""
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                _parser_arguments(sub, f"{name} {sub_name}", out)
            continue
        label = action.option_strings or [action.metavar or action.dest]
        out.append((name, label, (action.help or "").strip()))
    return out


def test_every_cli_argument_has_help():
    missing = [f"{cmd} {'/'.join(flags)}"
               for cmd, flags, text in _parser_arguments(make_parser(), "trainmover", [])
               if not text]
    assert not missing, (f"{len(missing)} command line arguments have no help text (add "
                         f"help= in trainmover/cli/):\n  " + "\n  ".join(missing))


def test_every_cli_argument_is_in_the_reference():
    sections = _sections(ref.cli_markdown())
    absent = []
    for cmd, flags, _ in _parser_arguments(make_parser(), "trainmover", []):
        text = sections.get(cmd)
        if text is None:
            absent.append(f"{cmd} (no section)")
            continue
        absent += [f"{cmd} {flag}" for flag in flags if f"`{flag}`" not in text]
    assert not absent, "missing from the generated CLI reference:\n  " + "\n  ".join(absent)


def _job_fields() -> list[tuple[str, str]]:
    """(section, field) of every setting, walked here independently of the generator."""
    out = []
    for f in dataclasses.fields(JobConfig):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING \
            else f.default
        if dataclasses.is_dataclass(default):
            out += [(f.name, g.name) for g in dataclasses.fields(default)]
        else:
            out.append(("job", f.name))
    return out


def test_every_setting_has_a_doc():
    docs = {s.key: s.doc for s in ref.config_settings()}
    missing = [f"{section}.{name}" if section != "job" else name
               for section, name in _job_fields()
               if not docs.get(name if section == "job" else f"{section}.{name}")]
    assert not missing, (f"{len(missing)} settings have no doc (a # comment directly above "
                         f"or beside the field, or a ``name``: entry in its section's "
                         f"docstring):\n  " + "\n  ".join(missing))


def test_every_setting_is_in_the_reference():
    sections = _sections(ref.config_markdown())
    absent = []
    for section, name in _job_fields():
        key = name if section == "job" else f"{section}.{name}"
        if f"`{key}`" not in sections.get(section, ""):
            absent.append(key)
    assert not absent, "missing from the generated settings reference:\n  " + "\n  ".join(absent)


def test_field_docs_take_comments_above_beside_and_docstring_entries():
    @dataclasses.dataclass
    class Sample:
        """A sample section. ``entry``: from the docstring.

        ``shared_b`` is mentioned here too."""

        # above a field
        # on two lines
        above: int = 1
        beside: int = 2        # beside a field
                               # and continued
        entry: int = 3
        # a block for shared_a and shared_b
        shared_a: int = 4
        shared_b: int = 5
        none: int = 6

    docs = ref.field_docs(Sample)
    assert docs["above"] == ("above a field on two lines", "comment")
    assert docs["beside"] == ("beside a field and continued", "comment")
    assert docs["entry"] == ("from the docstring.", "docstring")
    assert docs["shared_a"][1] == "comment"
    assert docs["shared_b"] == ("a block for shared_a and shared_b", "shared comment")
    assert docs["none"] == ("", "")


def test_default_markers_name_real_settings():
    assert ref.setting_default("checkpoint.every") == str(JobConfig().checkpoint.every)
    with pytest.raises(KeyError):
        ref.setting_default("checkpoint.no_such_setting")
    pages = "".join(p.read_text() for p in (ROOT / "docs").rglob("*.md"))
    for key in ref.DEFAULT_MARK.findall(pages):
        ref.setting_default(key)   # an unknown one raises, naming it


def test_every_benchmark_result_is_on_the_results_page():
    page = ref.benchmarks_markdown()
    results = ROOT / "benchmarks" / "results"
    jsons = {p.stem for p in results.glob("*.json")}
    absent = [s for s in sorted(jsons) if f"### {s} " not in page]
    absent += [p.name for p in results.glob("*.md") if p.stem not in jsons
               and f"({p.name})" not in page and f"/{p.name})" not in page]
    assert not absent, "missing from the generated results page: " + ", ".join(absent)


def test_mkdocs_build_strict(tmp_path):
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed (it comes with the test extra: "
                    "pip install -e '.[test]')")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                           "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(site)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout + done.stderr
    for page in ("index.html", "reference/cli/index.html", "reference/config/index.html",
                 "reference/benchmark-results/index.html"):
        assert (site / page).is_file(), page
