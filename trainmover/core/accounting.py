"""Pure arithmetic over committed-step records: the watchdog's stall rule and the
downtime of an event. No torch, no store: tested on synthetic records."""
from __future__ import annotations

import statistics


def stalled_for(commit_times: list[float], now: float, factor: float, floor_s: float
                ) -> float | None:
    """Seconds since the last committed step, if that is beyond the watchdog's limit
    (``factor`` x the median gap between the recent commits, at least ``floor_s``); None
    while the job progresses, or before it has a step time (fewer than 4 commits)."""
    if len(commit_times) < 4:
        return None
    gaps = sorted(b - a for a, b in zip(commit_times, commit_times[1:]))
    limit = max(floor_s, factor * gaps[len(gaps) // 2])
    idle = now - commit_times[-1]
    return idle if idle > limit else None


def downtime_from_metrics(records: list[dict], event_step: int, baseline_steps: int = 5
                          ) -> tuple[float, float]:
    """The job's gap between committing the last step before the event and committing the
    first step after it, minus a normal gap (the median of the gaps just before, so any
    per-step cost a strategy always pays, such as a checkpoint, is not counted as downtime).
    Returns (downtime_s, normal_gap_s)."""
    t = {r["step"]: r["time"] for r in records}
    gaps = [t[s] - t[s - 1] for s in range(max(2, event_step - baseline_steps), event_step)
            if s in t and s - 1 in t]
    normal = statistics.median(gaps) if gaps else 0.0
    return max(0.0, t[event_step] - t[event_step - 1] - normal), normal


def stayer_downtime(first_step: int, prepare_step: int, switch_step: int, ends: list[float],
                    after: int, baseline: int) -> tuple[float, float, float] | None:
    """One stayer's downtime for a switch at ``switch_step``, from the wall times at which
    its steps ended (``ends[i]`` for step ``first_step + i``): the time from the end of the
    step before the switch to the end of ``after`` steps past it, minus as many normal steps
    (a stall that spills into the steps after the switch is counted). Normal is the median
    of up to ``baseline`` step-to-step gaps that ended before phase 1 began at
    ``prepare_step`` (background preparation may slow the steps during phase 1).
    Returns (downtime_s, normal_gap_s, noise_s) or None without a gap to measure normal by;
    noise is the spread (max - min) of those normal gaps: a downtime inside it is no
    measurable stall. Not clamped: a negative value is noise, reported as measured."""
    t = {first_step + i: e for i, e in enumerate(ends)}
    last = switch_step + after
    if switch_step - 1 not in t or last not in t:
        return None
    gaps = [t[s] - t[s - 1] for s in range(prepare_step - baseline, prepare_step)
            if s in t and s - 1 in t]
    if not gaps:
        return None
    normal = statistics.median(gaps)
    span = t[last] - t[switch_step - 1]
    return span - (after + 1) * normal, normal, max(gaps) - min(gaps)


def phase_one_extra(first_step: int, prepare_step: int, switch_step: int, ends: list[float],
                    normal: float) -> float | None:
    """What phase 1 (groups built in the background while training goes on) cost a stayer:
    the time its steps from ``prepare_step`` up to the switch took beyond as many normal
    steps. Not downtime (training went on), but a cost all the same: on shared cores the
    background work slows the steps."""
    t = {first_step + i: e for i, e in enumerate(ends)}
    if prepare_step - 1 not in t or switch_step - 1 not in t:
        return None
    return t[switch_step - 1] - t[prepare_step - 1] - (switch_step - prepare_step) * normal


def slowest_stayer(accounts: dict[str, tuple[float, float, float]]
                   ) -> tuple[str, float, float, float] | None:
    """The stayer whose downtime was the largest: (name, downtime_s, normal_gap_s, noise_s);
    None when there is none. The job waits for its slowest member."""
    if not accounts:
        return None
    name = max(accounts, key=lambda w: accounts[w][0])
    return (name, *accounts[name])


# --- how a downtime reads -----------------------------------------------------------------
# One rule for every place a person reads a downtime (the dashboard, `trainmover status`,
# `trainmover report`, the demo's summary, the controller's progress line, the bench
# tables): a downtime at or below zero, or inside the spread of the normal steps it was
# measured against, is no measurable stall. Saying so, with that spread beside it, is the
# honest reading; a number there (negative ones included) would only be noise.

def within_noise(downtime_s: float | None, noise_s: float | None) -> bool:
    """True where a measured downtime is no measurable stall: at or below zero, or at most
    the step noise (``noise_s``: the spread of the normal steps, ``stayer_downtime``)."""
    if downtime_s is None:
        return False
    return downtime_s <= 0 or (noise_s is not None and downtime_s <= noise_s)


def fmt_seconds(seconds: float) -> str:
    """A duration as a person reads it: milliseconds below a second, else seconds."""
    return f"{seconds * 1000:.1f} ms" if abs(seconds) < 1 else f"{seconds:.2f} s"


def downtime_value(downtime_s: float | None, noise_s: float | None) -> str:
    """What a downtime was, with its noise beside it: "40.4 ms (step noise ±3.1 ms)",
    "no measurable stall (within step noise, ±8.0 ms)", "not measured"."""
    if downtime_s is None:
        return "not measured"
    noise = None if noise_s is None else fmt_seconds(noise_s)
    if within_noise(downtime_s, noise_s):
        return "no measurable stall (within step noise" + (f", ±{noise})" if noise else ")")
    return fmt_seconds(downtime_s) + (f" (step noise ±{noise})" if noise else "")


def downtime_phrase(downtime_s: float | None, noise_s: float | None) -> str:
    """``downtime_value`` as a phrase of its own: "downtime 40.4 ms (step noise ±3.1 ms)",
    "no measurable stall (within step noise, ±8.0 ms)", "downtime not measured"."""
    value = downtime_value(downtime_s, noise_s)
    return value if within_noise(downtime_s, noise_s) else f"downtime {value}"
