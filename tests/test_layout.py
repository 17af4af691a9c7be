"""The code's architecture, enforced: a torch-free core, imports pointing one way between the
folders (one per process kind over the core), and no import cycles."""
import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "trainmover"

# folder -> the folders it may import from (besides itself). Top-level modules (the Python
# API, the built-in trainer, recipes) are clients and may import anything; the CLI, a client
# too, is a folder (cli/) and so names the folders it imports.
ALLOWED = {
    "core": set(),
    "comm": {"core"},
    "train": {"core", "comm"},
    "worker": {"core", "comm", "train"},
    "control": {"core"},
    "agent": {"core"},
    # the operator view (dashboard, metrics, report) reads what the control plane offers
    # outside the job: the status, the client, maintenance
    "view": {"core", "control"},
    "bench": {"core", "comm", "train", "worker", "control", "agent", "recipes", "api"},
    # the command line, a client: each command hands its work to the folder that does it
    "cli": {"core", "control", "view", "agent", "bench", "recipes", "demo"},
}


def modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG.parent).with_suffix("")
        name = ".".join(rel.parts)
        out[name.removesuffix(".__init__")] = path
    return out


def type_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:``: read by type checkers, never run."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING",
                                                                  "typing.TYPE_CHECKING"):
            out.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return out


def imports_of(path: Path, name: str, run_time_only: bool = False) -> set[str]:
    """Every trainmover module ``name`` imports, at any depth of its code (with
    ``run_time_only``, leaving out the imports only a type checker reads)."""
    tree = ast.parse(path.read_text())
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    skip = type_only(tree) if run_time_only else set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("trainmover"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            if not base.startswith("trainmover"):
                continue
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in modules() else base)
    return found


def folder(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 else None   # trainmover.<folder>.<module>


def test_folders_import_one_way():
    bad = []
    for name, path in modules().items():
        src = folder(name)
        if src is None:
            continue
        for dep in imports_of(path, name):
            dst = folder(dep) if dep.count(".") >= 2 else dep.split(".")[1] if "." in dep else dep
            if dst in (None, src) or dep == "trainmover":
                if dep == "trainmover" and src in ALLOWED:
                    bad.append(f"{name} imports the package root (a client's entry point)")
                continue
            if dst not in ALLOWED[src]:
                bad.append(f"{name} imports {dep} ({src} -> {dst} is not allowed)")
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    # A type-only import (a step loop naming the Runtime that drives it) is not a cycle: it
    # never runs. The folder rule above still counts it.
    graph = {name: {d for d in imports_of(path, name, run_time_only=True)
                    if d in modules() and d != name}
             for name, path in modules().items()}
    for root in graph:   # package __init__ files are empty or lazy: drop edges into them
        graph[root] = {d for d in graph[root] if not modules()[d].name == "__init__.py"}
    state, stack, cycles = {}, [], []

    def visit(n):
        state[n] = "open"
        stack.append(n)
        for d in sorted(graph[n]):
            if state.get(d) == "open":
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[n] = "done"

    for n in sorted(graph):
        if n not in state:
            visit(n)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


@pytest.mark.timeout(60)
def test_the_core_and_the_package_root_import_no_torch():
    core = sorted(n for n in modules() if n.startswith("trainmover.core"))
    code = ("import sys, trainmover\n" + "".join(f"import {m}\n" for m in core) +
            "loaded = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]\n"
            "assert not loaded, loaded[:5]\nprint(len(sys.modules))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": str(PKG.parent)})
    assert res.returncode == 0, res.stderr
