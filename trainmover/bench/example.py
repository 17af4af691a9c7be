"""``bench example``: a user's DDP script under trainmover against the same script without it.

`examples/ddp_gpt_plain.py` (torch's DistributedDataParallel, launched by torchrun) and
`examples/ddp_gpt.py` (the same script made resilient, launched by `trainmover launch`; or
`examples/torch_ddp.py` with ``--script torch_ddp``: DistributedDataParallel kept, on
trainmover's process groups through the forwarding backend) both
print each step's time as rank 0 sees it from one step's end to the next, so everything the
runtime adds between steps (the commit vote, the boundary check, metrics) is counted. Runs
alternate between the two (ABBA order over the repeats), one intra-op thread per worker,
and the first steps (warm-up) are left out. The figure per run is its median step time;
per strategy the median over runs with min and max; the overhead is the ratio of medians,
with the spread of the per-pair ratios beside it.
"""
from __future__ import annotations

import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from trainmover.bench.report import git_commit, machine_description, write_result

SKIP = 5
_LINE = re.compile(r"^step (\d+) loss [0-9.]+ ([0-9.]+) ms$")


def _examples_dir() -> str:
    path = os.path.join(os.getcwd(), "examples")
    if not os.path.exists(os.path.join(path, "ddp_gpt.py")):
        raise ValueError(f"bench example runs from the repository root (no examples/ddp_gpt.py "
                         f"under {os.getcwd()!r})")
    return path


def _step_times(text: str) -> list[float]:
    out = {}
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if m:
            out[int(m.group(1))] = float(m.group(2)) / 1000
    return [out[k] for k in sorted(out)]


def run_plain(nproc: int, steps: int, timeout_s: float, script: str = "ddp_gpt") -> list[float]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={_nproc(script, nproc)}",
         os.path.join(_examples_dir(), f"{PLAIN[script]}.py"),
         "--steps", str(steps)], capture_output=True, text=True, timeout=timeout_s, env=env)
    if res.returncode != 0:
        raise RuntimeError(f"torchrun failed: {res.stderr[-2000:]}")
    return _step_times(res.stdout)


def run_trainmover(nproc: int, steps: int, timeout_s: float, scratch: str,
                   script: str = "ddp_gpt") -> list[float]:
    run_dir = os.path.join(scratch, f"tm-{time.time_ns()}")
    res = subprocess.run(
        [sys.executable, "-m", "trainmover", "launch",
         *LAYOUTS.get(script, ("--nproc", str(nproc))), "--threads", "1",
         "--run-dir", run_dir, "--quiet", *LAUNCH_FLAGS.get(script, ()), "--", sys.executable,
         os.path.join(_examples_dir(), f"{script}.py"), "--steps", str(steps)],
        capture_output=True, text=True, timeout=timeout_s)
    if res.returncode != 0:
        raise RuntimeError(f"trainmover launch failed: {res.stderr[-2000:]}")
    with open(os.path.join(run_dir, "logs", f"{PRINTER.get(script, 'w0')}.log")) as f:
        times = _step_times(f.read())
    shutil.rmtree(run_dir, ignore_errors=True)
    return times


# each resilient example and the plain torchrun script it was made from
PLAIN = {"ddp_gpt": "ddp_gpt_plain", "torch_ddp": "ddp_gpt_plain",
         "torch_fsdp": "torch_fsdp_plain", "torch_fsdp_tp": "torch_fsdp_tp_plain",
         "torch_pipeline": "torch_pipeline_plain"}
LAUNCH_FLAGS = {"torch_fsdp": ("--dp-sharded",), "torch_fsdp_tp": ("--dp-sharded",),
                "torch_pipeline": ("--dp-sharded",)}
# the 2-D examples' layouts (4 processes: --nproc is ignored) and the worker that prints
# the step lines (the pipeline's loss is on its last stage: w1 holds dp0.pp1)
LAYOUTS = {"torch_fsdp_tp": ("--dp", "2", "--tp", "2"),
           "torch_pipeline": ("--dp", "2", "--pp", "2")}
PRINTER = {"torch_pipeline": "w1"}
SCRIPTS = tuple(PLAIN)


def _nproc(script: str, nproc: int) -> int:
    layout = LAYOUTS.get(script)
    return nproc if layout is None else int(layout[1]) * int(layout[3])


def bench_example(nproc: int = 2, steps: int = 40, repeats: int = 3,
                  out_dir: str = "benchmarks/results", timeout_s: float = 600,
                  script: str = "ddp_gpt") -> dict:
    if script not in SCRIPTS:
        raise ValueError(f"--script must be one of {SCRIPTS}, got {script!r}")
    if steps <= SKIP + 5:
        raise ValueError(f"--steps must be > {SKIP + 5} (the first {SKIP} are warm-up)")
    scratch = tempfile.mkdtemp(prefix="tm-bench-example-")
    runs: dict[str, list[float]] = {"plain": [], "trainmover": []}
    order = []
    for r in range(repeats):
        pair = ("plain", "trainmover") if r % 2 == 0 else ("trainmover", "plain")
        for strategy in pair:
            times = run_plain(nproc, steps, timeout_s, script) if strategy == "plain" else \
                run_trainmover(nproc, steps, timeout_s, scratch, script)
            if len(times) != steps:
                raise RuntimeError(f"{strategy}: {len(times)} step times for {steps} steps")
            runs[strategy].append(statistics.median(times[SKIP:]))
            order.append(strategy)
            print(f"  {strategy:10s} run {r + 1}: median step {runs[strategy][-1] * 1000:.1f} ms",
                  flush=True)
    shutil.rmtree(scratch, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    pair_ratios = [t / p for t, p in zip(runs["trainmover"], runs["plain"])]
    ratio = med["trainmover"] / med["plain"]
    noise = max(max(v) / min(v) - 1 for v in runs.values())
    result = {
        "benchmark": "example", "script": script, "machine": machine_description(),
        "nproc": _nproc(script, nproc), "layout": list(LAYOUTS.get(script, ())),
        "steps": steps, "warmup_steps_skipped": SKIP, "repeats": repeats, "order": order,
        "median_step_s": {k: {"median": med[k], "min": min(v), "max": max(v), "runs": v}
                          for k, v in runs.items()},
        "overhead_ratio": ratio, "pair_ratios": pair_ratios,
        "run_to_run_spread": noise,
        "verdict": ("no measurable difference" if abs(ratio - 1) <= noise else
                    f"{(ratio - 1) * 100:+.1f}%"),
        "commit": git_commit(),
    }
    name = "example_overhead" if script == "ddp_gpt" else f"example_overhead_{script}"
    write_result(out_dir, name, result, _table(result))
    return result




def _table(r: dict) -> str:
    m = r["median_step_s"]
    script = r.get("script", "ddp_gpt")
    lines = [f"# bench example: examples/{script}.py under trainmover vs {PLAIN[script]}.py "
             f"under torchrun, {r['nproc']} processes, 1 thread each",
             "",
             f"Machine: {r['machine']['cpu']}, {r['machine']['cores']} cores, torch "
             f"{r['machine']['torch']}; commit {r['commit']}; {r['repeats']} interleaved "
             f"repeats of {r['steps']} steps (first {r['warmup_steps_skipped']} skipped); "
             f"step time = step end to step end on rank 0.",
             "",
             "| strategy | median step (ms) | min | max |",
             "|---|---|---|---|"]
    for k in ("plain", "trainmover"):
        lines.append(f"| {k} | {m[k]['median'] * 1000:.1f} | {m[k]['min'] * 1000:.1f} | "
                     f"{m[k]['max'] * 1000:.1f} |")
    lines += ["", f"trainmover / plain: **{r['overhead_ratio']:.3f}** (per pair "
                  f"{min(r['pair_ratios']):.3f}–{max(r['pair_ratios']):.3f}; run-to-run spread "
                  f"{r['run_to_run_spread'] * 100:.1f}%): {r['verdict']}", ""]
    return "\n".join(lines)
