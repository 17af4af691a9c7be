"""Job files and command-line overrides (``docs/config-files.md``): a ``JobConfig`` read
from a TOML file with one table per section (``[model]``, ``[train]``, ... as torchtitan's
job files), ``--section.field=value`` settings from the command line, each value converted
by the field's type annotation; and the inverse, a complete TOML job file of a configuration
with each field's doc as a comment (``trainmover config``). Torch-free.

Unknown sections and fields are named with the closest known name; a value of the wrong
type is named with its field and the type expected. Values are range-checked afterwards by
``JobConfig.validate``. TOML has no null: an optional field (``dashboard.port``) is unset
with the string ``"none"``."""
from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import io
import math
import re
import textwrap
import tokenize
import types
import typing

try:
    import tomllib
except ModuleNotFoundError:      # Python 3.10
    import tomli as tomllib

from trainmover.core.config import JobConfig
from trainmover.core.faults import WorkerFault

NONE = "none"                    # an optional field's value None, in a file or on the line
TRUE = ("true", "1", "yes", "on")
FALSE = ("false", "0", "no", "off")
ROOT_KEYS = ("name", "faults")   # JobConfig's fields that are not sections


# --- types -----------------------------------------------------------------------------------
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _unwrap(tp) -> tuple[type, bool]:
    """(the base type, whether None is allowed): ``int | None`` -> (int, True)."""
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is getattr(types, "UnionType", None):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return (args[0] if len(args) == 1 else object), True
    return (origin or tp), False


def _describe(tp) -> str:
    base, optional = _unwrap(tp)
    desc = {bool: "true or false", int: "an int", float: "a number (float)",
            str: "a string", list: "a list"}.get(base, getattr(base, "__name__", str(base)))
    return f'{desc} or "{NONE}"' if optional else desc


def _sections() -> dict[str, type]:
    return {name: tp for name, tp in _hints(JobConfig).items() if dataclasses.is_dataclass(tp)}


def _from_toml(value, tp, key: str):
    """A value as TOML typed it, for a field of type ``tp``; raises naming ``key``."""
    base, optional = _unwrap(tp)
    if optional and isinstance(value, str) and value.lower() == NONE:
        return None
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if base is bool and isinstance(value, bool) or base is str and isinstance(value, str) \
            or base is list and isinstance(value, list):
        return value
    if base is int and number and isinstance(value, int):
        return value
    if base is float and number:
        return float(value)
    raise ValueError(f"{key} must be {_describe(tp)}, got {value!r}")


def _from_text(text: str | None, tp, key: str):
    """A command-line value (a string, or None for a bare ``--section.field``)."""
    base, optional = _unwrap(tp)
    if text is None:
        if base is bool:
            return True
        raise ValueError(f"needs a value: --{key}=VALUE or --{key} VALUE")
    word = text.strip().lower()
    if optional and word == NONE:
        return None
    if base is bool:
        if word in TRUE or word in FALSE:
            return word in TRUE
        raise ValueError(f"{key} must be true or false (or 1/0, yes/no), got {text!r}")
    if base in (int, float):
        try:
            return base(text.strip())
        except ValueError:
            raise ValueError(f"{key} must be {_describe(tp)}, got {text!r}") from None
    if base is list:
        if not text.strip().startswith("["):
            return [item.strip() for item in text.split(",")] if text.strip() else []
        try:
            return tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{key} must be a list, as TOML ([\"a\", \"b\"]) or comma-"
                             f"separated (a,b), got {text!r}: {exc}") from None
    return _from_toml(text, tp, key)


# --- unknown names ---------------------------------------------------------------------------
def _unknown_section(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown section {name!r}{hint}; known: {', '.join(known)}"


def _unknown_field(section: str, name: str) -> str:
    sections = _sections()
    fields = list(_hints(sections[section]))
    close = [f"{section}.{c}" for c in difflib.get_close_matches(name, fields, n=1)]
    close = close or [f"{s}.{name}" for s, cls in sections.items() if name in _hints(cls)]
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown field {section}.{name}{hint}; fields of [{section}]: {', '.join(fields)}"


def _set(cfg: JobConfig, section: str, updates: dict) -> None:
    target = getattr(cfg, section)
    if type(target).__dataclass_params__.frozen:      # Layout: checked as it is built
        setattr(cfg, section, dataclasses.replace(target, **updates))
    else:
        for name, value in updates.items():
            setattr(target, name, value)


# --- job files -------------------------------------------------------------------------------
def read_job_file(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ValueError(f"job file {path!r}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"job file {path!r} is not valid TOML: {exc}") from None


def apply_job_file(cfg: JobConfig, path: str) -> JobConfig:
    """Set every field the file names (the others keep ``cfg``'s values)."""
    return apply_table(cfg, read_job_file(path), f"job file {path!r}")


def apply_table(cfg: JobConfig, table: dict, where: str = "job file") -> JobConfig:
    sections = _sections()
    try:
        for key, value in table.items():
            if key in sections:
                if not isinstance(value, dict):
                    raise ValueError(f"{key} must be a table ([{key}]), got {value!r}")
                hints = _hints(sections[key])
                updates = {}
                for name, v in value.items():
                    if name not in hints:
                        raise ValueError(_unknown_field(key, name))
                    updates[name] = _from_toml(v, hints[name], f"{key}.{name}")
                _set(cfg, key, updates)
            elif key == "faults":
                cfg.faults = _faults(value)
            elif key in ROOT_KEYS:
                setattr(cfg, key, _from_toml(value, _hints(JobConfig)[key], key))
            else:
                raise ValueError(_unknown_section(key, [*ROOT_KEYS, *sections]))
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    return cfg


def _faults(value) -> list[dict]:
    """``faults``: a list of tables, each a ``faults.WorkerFault``."""
    if not isinstance(value, list):
        raise ValueError(f"faults must be a list of tables, got {value!r}")
    hints, out = _hints(WorkerFault), []
    for i, table in enumerate(value):
        if not isinstance(table, dict):
            raise ValueError(f"faults[{i}] must be a table {{ worker = ..., point = ... }}, "
                             f"got {table!r}")
        for name in table:
            if name not in hints:
                close = difflib.get_close_matches(name, list(hints), n=1)
                raise ValueError(f"unknown field faults[{i}].{name}" +
                                 (f" (did you mean {close[0]!r}?)" if close else "") +
                                 f"; fields: {', '.join(hints)}")
        missing = [f.name for f in dataclasses.fields(WorkerFault)
                   if f.default is dataclasses.MISSING and f.name not in table]
        if missing:
            raise ValueError(f"faults[{i}] needs {', '.join(missing)}")
        fault = WorkerFault(**{k: _from_toml(v, hints[k], f"faults[{i}].{k}")
                               for k, v in table.items()})
        fault.validate()
        out.append(dict(fault.__dict__))
    return out


# --- command-line overrides ------------------------------------------------------------------
_OVERRIDE = re.compile(r"--([A-Za-z_][\w-]*(?:\.[\w-]+)+)(?:=(.*))?", re.S)


def split_overrides(argv: list[str]) -> tuple[list[str], list[tuple[str, str | None]]]:
    """``argv`` without its ``--section.field=value`` and ``--section.field value`` settings,
    and those settings as (``section.field``, value); a bare ``--section.field`` (followed by
    another option or nothing) has the value None (true, for a bool field)."""
    rest, found, i = [], [], 0
    while i < len(argv):
        m = _OVERRIDE.fullmatch(argv[i])
        i += 1
        if not m:
            rest.append(argv[i - 1])
            continue
        value = m[2]
        if value is None and i < len(argv) and not argv[i].startswith("--"):
            value, i = argv[i], i + 1
        found.append((m[1], value))
    return rest, found


def apply_overrides(cfg: JobConfig, overrides: list[tuple[str, str | None]]) -> JobConfig:
    """Set ``section.field`` to each value, converted by the field's type."""
    sections = _sections()
    for key, text in overrides:
        section, _, name = key.replace("-", "_").partition(".")
        flag = f"--{key}" + ("" if text is None else f"={text}")
        if section not in sections:
            raise ValueError(f"{flag}: {_unknown_section(section, list(sections))}")
        hints = _hints(sections[section])
        if "." in name or name not in hints:
            raise ValueError(f"{flag}: {_unknown_field(section, name)}")
        try:
            _set(cfg, section, {name: _from_text(text, hints[name], f"{section}.{name}")})
        except ValueError as exc:
            raise ValueError(f"{flag}: {exc}") from None
    return cfg


# --- writing a job file ----------------------------------------------------------------------
def _toml_str(s: str) -> str:
    out = []
    for ch in s:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch in "\n\t\r":
            out.append({"\n": "\\n", "\t": "\\t", "\r": "\\r"}[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def toml_value(v) -> str:
    if v is None:
        return f'"{NONE}"'
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else ("nan" if v != v else "inf" if v > 0 else "-inf")
    if isinstance(v, str):
        return _toml_str(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):   # an inline table; None values are left out (their default)
        items = [f"{k if re.fullmatch(r'[A-Za-z0-9_-]+', k) else _toml_str(k)} = "
                 f"{toml_value(x)}" for k, x in v.items() if x is not None]
        return "{ " + ", ".join(items) + " }" if items else "{}"
    raise TypeError(f"no TOML form for {v!r}")


def _comment(text: str, width: int = 92) -> list[str]:
    text = re.sub(r"``([^`]*)``", r"`\1`", " ".join(text.split()))
    return ["# " + line for line in textwrap.wrap(text, width - 2)] if text else []


# --- field docs ------------------------------------------------------------------------------
# The one extractor of the settings' docs: the job files written here and the reference pages
# of the docs site (``trainmover/docs_reference.py``) both read them through it.

def class_doc(cls) -> str:
    """``cls``'s own docstring, cleaned ("" for none: a dataclass without one gets its
    signature as its docstring)."""
    doc = cls.__dict__.get("__doc__") or ""
    return "" if doc.startswith(cls.__name__ + "(") else inspect.cleandoc(doc)


def _comments(src: str) -> dict[int, tuple[int, str, bool]]:
    """line -> (column, text, whether it is alone on its line) of every comment in ``src``."""
    lines = src.splitlines()
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            out[row] = (col, tok.string.lstrip("#").strip(), not lines[row - 1][:col].strip())
    return out


def _docstring_entries(doc: str, names) -> tuple[list[str], dict[str, list[str]]]:
    """(the docstring's paragraphs less their field entries, {field: its entries}): an entry
    is ````name````: followed by its text, up to the next entry or the paragraph's end; only
    the names of fields (``names``) mark entries."""
    header: list[str] = []
    entries: dict[str, list[str]] = {}
    for para in re.split(r"\n\s*\n", doc):
        para = " ".join(para.split())
        if not para:
            continue
        marks = [m for m in re.finditer(r"``(\w+)``:\s*", para) if m[1] in names]
        if not marks:
            header.append(para)
            continue
        if para[:marks[0].start()].strip():
            header.append(para[:marks[0].start()].strip())
        for m, nxt in zip(marks, marks[1:] + [None]):
            entries.setdefault(m[1], []).append(
                para[m.end():nxt.start() if nxt else len(para)].strip())
    return header, entries


def _docstring_mention(doc: str, name: str) -> str:
    """The sentences of a docstring that name ``name`` in double backticks."""
    sentences = re.split(r"(?<=[.;])\s+(?=[A-Z`(])", " ".join(doc.split()))
    return " ".join(s for s in sentences if f"``{name}``" in s)


def _field_comments(cls, names) -> dict[str, tuple[list[str], list[str]]]:
    """field -> (its own comment lines, the comment blocks above the earlier fields of its
    run of fields, nearest first). Its own: the block of whole-line comments directly above
    it at its indentation, then the comment beside it with the deeper-indented comment
    lines that continue it. A run: fields with their comments, no other line between them.
    No source (a class made at run time): none."""
    try:
        src = textwrap.dedent(inspect.getsource(cls))
        comments = _comments(src)
        cdef = ast.parse(src).body[0]
    except (OSError, TypeError, SyntaxError, tokenize.TokenError, IndexError):
        return {}
    if not isinstance(cdef, ast.ClassDef):
        return {}
    nodes = [n for n in cdef.body if isinstance(n, ast.AnnAssign)
             and isinstance(n.target, ast.Name) and n.target.id in names]
    out: dict[str, tuple[list[str], list[str]]] = {}
    blocks: list[list[str]] = []       # each field's comment block above it
    spans: list[tuple[int, int]] = []  # first and last line of each field with its comments
    for node in nodes:
        above, row = [], node.lineno - 1
        while row in comments and comments[row][2] and comments[row][0] == node.col_offset:
            above.insert(0, comments[row][1])
            row -= 1
        own, last = list(above), node.end_lineno
        beside = [comments[r][1] for r in range(node.lineno, node.end_lineno + 1)
                  if r in comments and not comments[r][2]]
        if beside:
            own += beside
            row = node.end_lineno + 1
            while row in comments and comments[row][2] and comments[row][0] > node.col_offset:
                own.append(comments[row][1])
                last = row
                row += 1
        first = node.lineno - len(above)
        earlier, j, start = [], len(spans), first
        while j > 0 and spans[j - 1][1] + 1 == start:     # the run goes on above
            j -= 1
            earlier.append(" ".join(blocks[j]))
            start = spans[j][0]
        blocks.append(above)
        spans.append((first, last))
        out[node.target.id] = (own, earlier)
    return out


def field_doc_sources(cls) -> dict[str, tuple[str, str]]:
    """name -> (doc, where it came from) for every field of dataclass ``cls``. A field's doc,
    in this order of precedence:

    - ``"comment"``: the ``#`` block directly above the field (at its indentation) and the
      comment beside it (with the deeper-indented comment lines below that continue it),
      followed by its ````name````: entry in the class docstring if it also has one;
    - ``"docstring"``: its ````name````: entry in the class docstring;
    - ``"shared comment"``: the comment block above an earlier field of the same run of
      fields (no other line between them) that names it, nearest first: a block written
      for several fields;
    - ``"docstring mention"``: the docstring's sentences that name it in double backticks;
    - ``("", "")``: none."""
    names = [f.name for f in dataclasses.fields(cls)]
    doc = class_doc(cls)
    _, entries = _docstring_entries(doc, set(names))
    comments = _field_comments(cls, set(names))
    out: dict[str, tuple[str, str]] = {}
    for name in names:
        own, earlier = comments.get(name, ([], []))
        entry = " ".join(entries.get(name, []))
        shared = next((block for block in earlier
                       if re.search(rf"\b{re.escape(name)}\b", block)), "")
        if own:
            out[name] = (" ".join(own + ([entry] if entry else [])), "comment")
        elif entry:
            out[name] = (entry, "docstring")
        elif shared:
            out[name] = (shared, "shared comment")
        elif mention := _docstring_mention(doc, name):
            out[name] = (mention, "docstring mention")
        else:
            out[name] = ("", "")
    return out


def field_docs(cls) -> tuple[str, dict[str, str]]:
    """(the class's docstring less its field entries, paragraphs apart by blank lines,
    {field: doc}): each field's doc as ``field_doc_sources`` finds it."""
    names = {f.name for f in dataclasses.fields(cls)}
    header, _ = _docstring_entries(class_doc(cls), names)
    return "\n\n".join(header), {n: d for n, (d, _) in field_doc_sources(cls).items()}


def to_toml(cfg: JobConfig, title: str = "") -> str:
    """``cfg`` as a complete job file: every section and field, each with its doc."""
    lines = _comment(title) + ([""] if title else [])
    root_docs = field_docs(JobConfig)[1]
    sections = _sections()
    for f in dataclasses.fields(JobConfig):
        if f.name not in sections:
            lines += _comment(root_docs.get(f.name, ""))
            lines.append(f"{f.name} = {toml_value(getattr(cfg, f.name))}")
    for name, cls in sections.items():
        header, docs = field_docs(cls)
        lines.append("")
        for para in header.split("\n\n"):
            lines += _comment(para)
        lines.append(f"[{name}]")
        section = getattr(cfg, name)
        for f in dataclasses.fields(cls):
            lines += _comment(docs.get(f.name, ""))
            lines.append(f"{f.name} = {toml_value(getattr(section, f.name))}")
    return "\n".join(lines) + "\n"
