"""A run dir as a report to keep or send: PNG images (the loss and throughput over time with
the interruptions marked, each interruption's phases, and optionally ``bench downtime``
results) and one self-contained ``report.html`` that embeds them, so the file can be mailed
or attached to a ticket and opened offline (no external URL, script or stylesheet). Read
through ``runlog`` like the dashboard, so it works on a finished job, a running one and a
copy of one. Torch-free; matplotlib is used through its object API only (no pyplot state),
so it is safe inside a process that draws nothing else."""
from __future__ import annotations

import base64
import html
import json
import os
import statistics

from matplotlib.figure import Figure

from trainmover.core.accounting import downtime_phrase, downtime_value
from trainmover.view.runlog import MIGRATION_PHASES, RECOVERY_PHASES, Interruption, RunLog

# Fixed pixel size (WIDTH x HEIGHT at DPI), so every image lays out the same in the HTML
# and a test can check it; no bbox_inches="tight", which would change it.
WIDTH, HEIGHT, DPI = 1000, 450, 100
KIND_COLORS = {"planned": "tab:blue", "straggler": "tab:olive", "crash": "tab:red",
               "hang": "tab:purple", "host": "tab:brown", "commerr": "tab:orange"}
PHASE_COLORS = {key: f"C{i}" for i, (key, _, _) in enumerate(MIGRATION_PHASES + RECOVERY_PHASES)}
# The order bars and lines are drawn in: ours first, the baselines after, unknown ones last.
STRATEGY_ORDER = ("trainmover", "trainmover_cold", "naive", "restart")
LINE_STYLES = ("-", "--", ":", "-.")


def _figure() -> Figure:
    return Figure(figsize=(WIDTH / DPI, HEIGHT / DPI), dpi=DPI, layout="constrained")


def _save(fig: Figure, path: str) -> str:
    # no "Software" tag: it carries matplotlib's URL, and the report promises none
    fig.savefig(path, format="png", dpi=DPI, metadata={"Software": None})
    return path


def _secs(x: float | None) -> str:
    if x is None:
        return "-"
    # a group switch takes microseconds: "0.000" would say it took nothing
    return f"{x:.3f}" if x == 0 or abs(x) >= 0.001 else f"{x:.1e}"


def _t0(log: RunLog) -> float:
    """The job's start: times are shown as seconds since it, as a person reads a run."""
    if log.started and isinstance(log.started.get("time"), (int, float)):
        return float(log.started["time"])
    times = [p.time for p in log.series.points] + [i.time for i in log.interruptions]
    return min(times) if times else 0.0


def timeline_image(log: RunLog, path: str) -> str:
    fig = _figure()
    ax_loss, ax_tps = fig.subplots(2, 1, sharex=True)
    t0, pts = _t0(log), sorted(log.series.points, key=lambda p: p.time)
    loss = [(p.time - t0, p.loss) for p in pts if p.loss is not None]
    tps = [(p.time - t0, p.tokens_per_s) for p in pts if p.tokens_per_s is not None]
    if loss:
        ax_loss.plot(*zip(*loss), color="black", lw=1.2, label="loss")
    if tps:
        ax_tps.plot(*zip(*tps), color="tab:green", lw=1.2)
    ax_loss.set_ylabel("loss")
    ax_tps.set_ylabel("tokens/s")
    ax_tps.set_xlabel("seconds since the job started")
    seen: set[str] = set()
    for it in log.interruptions:
        color, end = KIND_COLORS.get(it.kind, "gray"), it.time - t0
        # the span covers the phases (background ones included), the line marks the end:
        # a downtime of milliseconds would be an invisible span on a job of minutes
        start = end - sum(p.seconds for p in it.phases)
        label = None if it.kind in seen else it.kind
        seen.add(it.kind)
        for ax in (ax_loss, ax_tps):
            ax.axvspan(start, end, color=color, alpha=0.2, lw=0)
            ax.axvline(end, color=color, lw=1.5, ls="--", label=label if ax is ax_loss else None)
    if ax_loss.get_legend_handles_labels()[0]:
        ax_loss.legend(loc="upper right", fontsize="small")
    fig.suptitle("loss and throughput; interruptions by kind")
    return _save(fig, path)


def interruptions_image(log: RunLog, path: str) -> str:
    fig = _figure()
    ax = fig.subplots()
    its = log.interruptions
    if not its:
        ax.set_axis_off()
        ax.text(0.5, 0.5, "no interruptions", ha="center", va="center", fontsize=20)
        return _save(fig, path)
    labelled: set[str] = set()
    for row, it in enumerate(its):
        left = 0.0
        for ph in it.phases:
            color = PHASE_COLORS.get(ph.name, "gray")
            # solid where training stood still (the downtime), light and hatched where it ran
            style = {"color": color} if ph.stalled else \
                {"color": color, "alpha": 0.35, "hatch": "//", "edgecolor": color}
            label = None if ph.name in labelled else ph.label
            labelled.add(ph.name)
            ax.barh(row, ph.seconds, left=left, height=0.6, label=label, **style)
            left += ph.seconds
        note = ("no downtime" if it.downtime_s is None else _downtime(it, phrase=True)) + \
            ("" if it.status == "done" else f" ({it.status})")
        ax.text(left, row, "  " + note, va="center", fontsize="small")
    ax.set_yticks(range(len(its)), [f"{it.title} ({it.kind})" for it in its])
    # every row shown (an aborted one has no bar to widen the axis), the first on top
    ax.set_ylim(len(its) - 0.5, -0.5)
    ax.set_xlabel("seconds")
    ax.margins(x=0.35)                       # room for the downtime beside the longest bar
    _legend_or_note(ax, "")
    ax.set_title("phases per interruption (solid: training stood still; hatched: background)")
    return _save(fig, path)


def read_bench(path: str) -> list[dict]:
    """The rows of a ``trainmover bench downtime`` result file: dicts with ``scenario``,
    ``strategy``, ``workers`` and ``downtime_s`` (None where that run failed)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except ValueError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    rows = data.get("results") if isinstance(data, dict) else None
    if not isinstance(rows, list) or not rows or not all(
            isinstance(r, dict) and isinstance(r.get("strategy"), str)
            and isinstance(r.get("workers"), int) and "downtime_s" in r for r in rows):
        raise ValueError(f"{path}: not a `trainmover bench downtime` result (expected "
                         f"'results': a list of rows with strategy, workers and downtime_s)")
    return [{**r, "scenario": r.get("scenario", "planned")} for r in rows]


def _strategies(rows: list[dict]) -> list[str]:
    found = {r["strategy"] for r in rows}
    return [s for s in STRATEGY_ORDER if s in found] + sorted(found - set(STRATEGY_ORDER))


def _legend_or_note(ax, note: str) -> None:
    if ax.get_legend_handles_labels()[0]:
        # outside the axes: the bars fill them, a legend inside would hide some
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    elif note:  # nothing drawn (every run failed): say so rather than leave an empty chart
        ax.text(0.5, 0.5, note, ha="center", va="center", transform=ax.transAxes)


def bench_images(path: str, rows: list[dict], out_dir: str) -> dict[str, str]:
    """``bench_<stem>.png`` for the rows ``read_bench(path)`` gave, and ``scaling_<stem>.png``
    where they span several worker counts."""
    stem = os.path.splitext(os.path.basename(path))[0]
    strategies = _strategies(rows)
    cells = sorted({(r["scenario"], r["workers"]) for r in rows})
    # repeated runs of a cell (``--repeats``): the bar is their median
    runs: dict[tuple, list[float]] = {}
    for r in rows:
        if isinstance(r["downtime_s"], (int, float)):
            runs.setdefault((r["scenario"], r["workers"], r["strategy"]), []).append(
                r["downtime_s"])
    value = {k: statistics.median(v) for k, v in runs.items()}
    fig = _figure()
    ax = fig.subplots()
    width = 0.8 / len(strategies)
    for k, strategy in enumerate(strategies):
        xs = [i + (k - (len(strategies) - 1) / 2) * width for i in range(len(cells))]
        ys = [value.get((*cell, strategy)) for cell in cells]
        # a failed or missing run has no bar; a zero one cannot sit on a log axis either
        got = [(x, y) for x, y in zip(xs, ys) if isinstance(y, (int, float)) and y > 0]
        if got:
            bars = ax.bar(*zip(*got), width=width, label=strategy)
            ax.bar_label(bars, [f"{y:.3g}" for _, y in got], fontsize="x-small")
    ax.set_yscale("log")
    ax.set_xticks(range(len(cells)), [f"{s}\n{n} workers" for s, n in cells])
    ax.set_ylabel("downtime (s, log scale)")
    _legend_or_note(ax, "no run of this file measured a downtime")
    ax.set_title(f"downtime by strategy ({os.path.basename(path)})")
    out = {f"bench_{stem}": _save(fig, os.path.join(out_dir, f"bench_{stem}.png"))}
    workers = sorted({n for _, n in cells})
    if len(workers) > 1:
        fig = _figure()
        ax = fig.subplots()
        scenarios = sorted({s for s, _ in cells})
        for scenario in scenarios:
            for strategy in strategies:
                pts = [(n, value.get((scenario, n, strategy))) for n in workers]
                pts = [(n, y) for n, y in pts if isinstance(y, (int, float)) and y > 0]
                if pts:
                    # a strategy keeps its colour from the bar chart; scenarios differ by line
                    name = strategy if len(scenarios) == 1 else f"{strategy} ({scenario})"
                    ax.plot(*zip(*pts), marker="o", label=name,
                            color=f"C{strategies.index(strategy)}",
                            ls=LINE_STYLES[scenarios.index(scenario) % len(LINE_STYLES)])
        ax.set_yscale("log")
        ax.set_xticks(workers)
        ax.set_xlabel("workers")
        ax.set_ylabel("downtime (s, log scale)")
        _legend_or_note(ax, "no strategy measured at several job sizes")
        ax.set_title(f"downtime vs job size ({os.path.basename(path)})")
        out[f"scaling_{stem}"] = _save(fig, os.path.join(out_dir, f"scaling_{stem}.png"))
    return out


def _table(head: list[str] | None, rows: list[list[str]]) -> str:
    esc = html.escape
    return ("<table>" + ("<tr>" + "".join(f"<th>{esc(h)}</th>" for h in head) + "</tr>"
                         if head else "") +
            "".join("<tr>" + "".join(f"<td>{esc(str(c))}</td>" for c in r) + "</tr>"
                    for r in rows) + "</table>")


def _header(run_dir: str, log: RunLog, summary: dict) -> list[list[str]]:
    # a running job has no summary.json yet: fall back on what its events say
    layout = summary.get("layout") or (log.started or {}).get("layout") or {}
    ended = log.ended or {}
    return [["job", summary.get("name") or os.path.basename(os.path.abspath(run_dir))],
            ["layout", " x ".join(f"{k.upper()}{v}" for k, v in layout.items()) or "-"],
            ["status", (ended.get("event") or "running (no end event yet)")],
            ["steps", str(summary.get("steps", log.last.step + 1 if log.last else "-"))],
            ["wall time (s)", _secs(summary.get("wall_s", ended.get("wall_s")))],
            ["mean step time (s)", _secs(summary.get("mean_step_time_s"))],
            ["final loss", str(summary.get("final_loss", "-"))],
            ["weights sha256", summary.get("weights_sha256", ended.get("weights_sha256", "-"))]]


def _cell(x) -> str:
    return "-" if x is None else f"{x:.3g}" if isinstance(x, float) else str(x)


def _data_uri(path: str) -> str:
    with open(path, "rb") as f:
        return "data:image/png;base64," + base64.b64encode(f.read()).decode("ascii")


def _downtime(it: Interruption, phrase: bool = False) -> str:
    """The interruption's downtime as every other place reads it (``core/accounting.py``):
    one inside the step noise says so, with the noise beside it."""
    noise = it.record.get("downtime_noise_s")
    return (downtime_phrase if phrase else downtime_value)(it.downtime_s, noise)


def _interruption_row(it: Interruption) -> list[str]:
    phases = "; ".join(f"{p.label} {_secs(p.seconds)}" for p in it.phases) or "-"
    return [it.title, it.kind, it.status, "-" if it.step is None else str(it.step),
            "-" if it.downtime_s is None else _downtime(it),
            ", ".join(w for w in it.workers if w) or "-", phases]


def write_report(run_dir: str, out_dir: str | None = None,
                 bench: list[str] | None = None) -> dict[str, str]:
    """Write the images and ``report.html`` for ``run_dir`` into ``out_dir`` (default
    ``<run_dir>/report``); returns {"html": path, "<image name>": path, ...}."""
    out_dir = out_dir or os.path.join(run_dir, "report")
    os.makedirs(out_dir, exist_ok=True)
    log = RunLog(run_dir).refresh()
    try:
        with open(os.path.join(run_dir, "summary.json")) as f:
            summary = json.load(f)
    except (OSError, ValueError):
        summary = {}
    summary = summary if isinstance(summary, dict) else {}
    # bench files are checked before anything is drawn: a bad one fails fast
    bench_rows = [(p, read_bench(p)) for p in bench or []]
    images = {"timeline": timeline_image(log, os.path.join(out_dir, "timeline.png")),
              "interruptions": interruptions_image(log, os.path.join(out_dir,
                                                                     "interruptions.png"))}
    for p, rows in bench_rows:
        images.update(bench_images(p, rows, out_dir))
    t0 = _t0(log)
    straggler_rows = [[_cell(s.get(k)) for k in ("worker", "role", "step", "score",
                                                 "reference", "excess_s", "policy")]
                      + [_secs(s["time"] - t0) if isinstance(s.get("time"), (int, float))
                         else "-"] for s in log.stragglers]
    counts = [[f"{plural} {status}", str(n)] for what, plural in (("migration", "migrations"),
                                                                   ("recovery", "recoveries"))
              for status, n in sorted(log.by_status(what).items())]
    counts += [[f"failures: {kind}", str(n)] for kind, n in sorted(log.failures.items())]
    imgs = "".join(
        f'<figure><img alt="{html.escape(name)}" src="{_data_uri(path)}">'
        f"<figcaption>{html.escape(os.path.basename(path))}</figcaption></figure>"
        for name, path in images.items())
    header = _header(run_dir, log, summary)
    title = html.escape(f"trainmover report: {header[0][1]}")
    page = (
        f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>{title}</title><style>'
        "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;margin:1em 0}"
        "td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}img{max-width:100%}"
        f"</style></head><body><h1>{title}</h1>"
        + _table(None, header)
        + "<h2>Interruptions</h2>"
        + (_table(["what", "kind", "status", "step", "downtime", "workers",
                   "phases (s)"], [_interruption_row(i) for i in log.interruptions])
           if log.interruptions else "<p>none</p>")
        + "<h2>Stragglers</h2>"
        + (_table(["worker", "role", "step", "score", "reference", "excess (s)", "policy",
                   "found at (s)"], straggler_rows) if straggler_rows else "<p>none</p>")
        + "<h2>Counts</h2>" + (_table(["", "count"], counts) if counts else "<p>none</p>")
        + f"<h2>Images</h2>{imgs}</body></html>")
    path = os.path.join(out_dir, "report.html")
    with open(path, "w") as f:
        f.write(page)
    return {"html": path, **images}
