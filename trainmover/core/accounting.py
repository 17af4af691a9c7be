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
