"""What every benchmark writes: the machine, the commit, a JSON result and a Markdown table
under ``benchmarks/results/``."""
from __future__ import annotations

import atexit
import json
import os
import statistics
import platform
import time


def machine_description() -> dict:
    import torch   # here, not at the top: the torch-free benches (project) use the rest

    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version(), "platform": platform.platform()}


class BenchLine:
    """Where a long benchmark is. On a terminal, one line redrawn in place (the run in
    progress out of how many, time elapsed, an estimate of the time left from the runs done)
    with each run's result printed above it; elsewhere (logs, CI) the results' plain lines
    only. Drawn only between runs, never while one is timed."""

    def __init__(self, name: str, total: int, clock=time.monotonic):
        from trainmover.control.context import LiveLine

        self.name, self.total, self.done = name, total, 0
        self.clock = clock
        self.t0 = clock()
        self.live = LiveLine.make()
        if self.live is not None:
            # a bench that fails mid-way still gives the terminal back (cursor, line)
            atexit.register(self.close)

    def start(self, what: str) -> None:
        if self.live is None:
            return
        elapsed = self.clock() - self.t0
        left = (f", about {_minutes(elapsed / self.done * (self.total - self.done))} left"
                if self.done else "")
        self.live.show(f"{self.name}: run {self.done + 1}/{self.total}: {what}  "
                       f"({_minutes(elapsed)} elapsed{left})", force=True)

    def finish(self, result: str) -> None:
        self.done += 1
        if self.live is None:
            print(result, flush=True)
        else:
            self.live.say(result)

    def close(self) -> None:
        live, self.live = self.live, None
        if live is not None:
            live.close()


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}:{int(seconds % 60):02d}"


def git_commit() -> str | None:
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or None
    except OSError:
        return None


def spread(values: list[float]) -> dict:
    """A figure over repeats: its median, beside its min and max."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def fmt_spread(s: dict | None, digits: int = 3, missing: str = "-") -> str:
    """A ``spread`` as "median (min-max)"; ``missing`` where there is none."""
    if not s:
        return missing
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def read_result(path: str, flag: str, benchmark: str) -> dict:
    """A result file of ``trainmover bench <benchmark>`` given as ``flag``; ``ValueError``
    naming the flag and the file where it cannot be read or is another bench's."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{flag} {path!r}: {exc}") from None
    if not isinstance(data, dict) or data.get("benchmark") != benchmark:
        raise ValueError(f"{flag} {path!r}: not a `trainmover bench {benchmark}` result")
    return data


def write_script_result(out_dir: str, name: str, benchmark: str, table: str,
                        **fields) -> None:
    """A ``benchmarks/*.py`` script's result: ``write_result`` of ``fields`` with the
    benchmark's name, the command as run and the commit, the markdown headed by both."""
    import sys

    command = f"python benchmarks/{os.path.basename(sys.argv[0])} " + " ".join(sys.argv[1:])
    result = {"benchmark": benchmark, "command": command, "commit": git_commit(), **fields}
    write_result(out_dir, name, result,
                 f"Command: `{command}`; commit {result['commit']}\n\n{table}\n")


def write_result(out_dir: str, name: str, result: dict, table: str,
                 json_path: str | None = None) -> None:
    """``<name>.json`` and ``<name>.md`` under ``out_dir``, the table printed; with
    ``json_path``, also ``{"results": result["results"]}`` there (``--json FILE``)."""
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"results": result["results"]}, f, indent=2)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=2)
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(table)
    print(table)
