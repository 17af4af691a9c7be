"""``trainmover bench quick`` (``make bench-quick``): the README's headline cells in minutes on
a small machine. It is ``bench downtime`` (``bench/downtime.py``: same jobs, same accounting,
same result format, so ``trainmover report --bench`` and ``trainmover project`` read it)
restricted to three cells, at one small size, eager, with few steps:

- a planned migration into a warm standby (strategy ``trainmover``, scenario ``planned``);
- a crash recovered into a warm standby (``trainmover``, ``crash``: SIGKILL from outside);
- a stop and restart of every process from the step's checkpoint (``restart``, ``planned``).

Each figure is the median of the repeats with their min and max; the file names the command,
the commit and the machine. ``quick.md`` leads with those three figures, then the full
``bench downtime`` table of the same runs."""
from __future__ import annotations

import time

from trainmover.bench.downtime import bench_downtime, downtime_table
from trainmover.core.accounting import downtime_value, fmt_seconds, within_noise

# (scenario, strategy, what a person calls it), in the order of the headline
CELLS = (("planned", "trainmover", "planned migration to a warm standby"),
         ("crash", "trainmover", "crash recovered into a warm standby"),
         ("planned", "restart", "stop and restart from a checkpoint"))


def bench_quick(workers: int = 4, repeats: int = 3, event_step: int = 8,
                out_dir: str = "benchmarks/results", name: str = "quick",
                command: str | None = None) -> dict:
    t0 = time.monotonic()
    result = bench_downtime([workers], compile=False, event_step=event_step, out_dir=out_dir,
                            strategies=("trainmover", "restart"), name=name,
                            repeats=repeats, cells=[c[:2] for c in CELLS], table=quick_table,
                            command=command)
    # the wall time is known only now: the files are written once more with it
    result["wall_s"] = round(time.monotonic() - t0, 1)
    from trainmover.bench.report import write_result

    write_result(out_dir, name, result, quick_table(result))
    return result


def headline(cell: dict | None) -> str:
    """One cell's figure as the headline gives it: median (min-max) over the repeats, the
    step noise beside it; inside the noise, the words instead of a number (never a negative
    one: ``core/accounting.py``)."""
    if cell is None or "downtime_s" not in cell:
        return "no run of this cell succeeded" if cell else "not run"
    d, noise = cell["downtime_s"], cell.get("downtime_noise_s")
    noise_s = noise["median"] if noise else None
    if within_noise(d["median"], noise_s):
        return downtime_value(d["median"], noise_s)

    def bound(x: float) -> str:   # an extreme inside the noise is no stall, not a number
        return "no stall" if within_noise(x, noise_s) else fmt_seconds(x)
    return (f"{fmt_seconds(d['median'])} ({bound(d['min'])} to {bound(d['max'])})"
            + (f", step noise ±{fmt_seconds(noise_s)}" if noise_s is not None else ""))


def quick_table(r: dict) -> str:
    by = {(c["scenario"], c["strategy"]): c for c in r["cells"]}
    workers = sorted({c["workers"] for c in r["cells"]}) or ["?"]
    m = r["machine"]
    wall = f"; took {r['wall_s'] / 60:.1f} min" if r.get("wall_s") else ""
    lines = [f"# bench quick: the headline cells ({', '.join(map(str, workers))} workers, "
             f"eager, event at step {r['event_step']}, {r['repeats']} repeats)", "",
             f"command: `{r.get('command') or 'trainmover bench quick'}`; commit "
             f"{r.get('commit')}; machine: {m['cpu']}, {m['cores']} cores, torch "
             f"{m['torch']}{wall}", "",
             "Downtime, median of the repeats (min to max); a downtime inside the step noise "
             "is no measurable stall.", "",
             "| what | downtime | detection | runs (failed) |", "|---|---|---|---|"]
    for scenario, strategy, what in CELLS:
        c = by.get((scenario, strategy))
        detect = c.get("detection_latency_s") if c else None
        lines.append(f"| {what} (`{strategy}`, {scenario}) | {headline(c)} | "
                     + (f"{fmt_seconds(detect['median'])}" if detect else "-") + " | "
                     + (f"{c['runs']} ({c['failed']})" if c else "0") + " |")
    for x in r["ratios"]:
        if (x["scenario"], x["strategy"]) == ("planned", "trainmover"):
            lines += ["", "Stop-and-restart over the planned migration: " + (
                f"the migration is within step noise; restart is at least {x['at_least']:.0f}x "
                f"that noise" if x.get("within_noise") and x.get("at_least") else
                "the migration is within step noise" if x.get("within_noise") else
                f"{x['median']:.0f}x (ratio of medians" + (
                    f"; {x['min']:.0f}x to {x['max']:.0f}x from the extremes)"
                    if x.get("min") and x.get("max") else ")"))]
    body = downtime_table(r).replace("# bench downtime:", "## The same runs in full (bench "
                                     "downtime):", 1)
    return "\n".join(lines) + "\n\n" + body
