"""Telling a sick worker from a role that is slow by design: the straggler detector and the
policy's cost rule. Pure: fed with each worker's per-window step measurements
(``protocol.StepPerf``), it returns verdicts; the controller's driver
(``control/stragglers.py``) reads the measurements and acts.

What is compared. Each worker measures, per step, its *compute* time: the step's wall time
minus the time it spent blocked in its groups' operations and the commit vote (on CPU, its
main thread's CPU time, which descheduling does not inflate). A slow worker's compute
grows; the peers it delays wait longer but compute as before, so the slow one is told apart
from the peers it holds up. Measurements come as the median over a window of ``window`` steps.

Against whom:
- its *peers*: the workers of the other data-parallel replicas in the same pipeline stage and
  tensor-parallel shard (the same work by construction). A step with longer sequences for
  everyone, or everyone slowed together, moves the peers too: no verdict. A last stage that
  is heavier by design is only compared with other last stages.
- without peers (``dp`` 1), its *own baseline*: the median of its first ``baseline_windows``
  windows in its role (after ``settle_windows``, which cover start-up: compilation, cold
  caches, a standby's first steps after a promotion).

The rule: a worker is a *straggler* when the median, over its last ``min_windows`` windows,
of its compute over the reference (the peers' median, else its baseline) is at least
``1 + min_shift``: a minimum shift and a minimum duration (with 5 windows, 3 of them slow),
so one noisy window or a garbage-collection pause is not enough, nor does one lucky window
hide a slow worker. It stays one until that median falls below ``1 + min_shift / 2``.
``score`` = reference / own compute over the same last windows (the reciprocal of the median
ratio the rule uses, so one noisy window does not move it), as the resiliency extension
scores ranks (1.0: as fast as the reference; 0.77: 1.3x slower).
"""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from statistics import median

from trainmover.core.topology import Role


@dataclass(frozen=True)
class DetectorSettings:
    """The defaults, from a simulation of 8 workers (DP4 x PP2) over 300 steps, 200 runs per
    setting, each step's time drawn with uniform per-step noise: windows of 8 steps, a shift
    of 0.15 and the median of the last 5 windows flagged no worker at +-10% noise (0/200)
    and a healthy one in 4/200 runs at +-20%, and found a 1.2x slower worker in 50/50 runs
    (+-10%), a median 27 steps after its onset; a 1.3x one at +-20% in 50/50, also 27 steps.
    With 3 windows: 19 steps, but 48/200 runs with a false positive at +-20%; windows of 5
    steps: 87/200 (``tests/test_stragglers.py`` keeps the +-20% case)."""

    window: int = 8
    min_shift: float = 0.15
    min_windows: int = 5
    settle_windows: int = 2
    baseline_windows: int = 3


@dataclass(frozen=True)
class Window:
    """One worker's window of steps: median compute seconds over steps ``first..last``, in the
    role it has held since ``tenure_start``."""

    worker: str
    role: Role
    first: int
    last: int
    tenure_start: int
    compute_s: float


@dataclass(frozen=True)
class Verdict:
    worker: str
    role: str
    score: float                 # reference / own compute, last windows (lower: slower)
    reference: str               # "peers" | "baseline"
    slow_windows: int            # consecutive windows over the shift so far
    straggler: bool              # the median of the last min_windows is over the shift
    excess_s: float              # own compute - reference, per step
    step: int                    # the window's last step


@dataclass
class _Track:
    """One worker's history in its tenure. Numbers and tuples of numbers only, and lists
    changed in place: a tuple of numbers is one the garbage collector stops tracking, so at
    16K workers a window leaves no new long-lived objects for its full collections to walk
    (tracks holding each window's ``Window`` made them 0.1-0.2 s pauses of the controller)."""
    tenure_start: int
    last: int = -1                                        # the newest window's last step
    seen: int = 0                                         # windows seen in this tenure
    baseline: list[float] = field(default_factory=list)   # the windows after settling
    # (index, last step, compute s) of the last windows, oldest first
    recent: list[tuple[int, int, float]] = field(default_factory=list)
    position: tuple[int, int] = (0, 0)                    # the newest window's (pp, tp)
    ratios: list[float] = field(default_factory=list)    # own / reference, last windows
    slow: int = 0                                         # consecutive slow windows
    straggler: bool = False


def _keep_last(values: list, value, n: int) -> None:
    """``values`` becomes its last ``n`` items after appending ``value``, in place."""
    values.append(value)
    del values[:-n]


class StragglerDetector:
    def __init__(self, settings: DetectorSettings):
        self.s = settings
        self._tracks: dict[str, _Track] = {}

    def seen(self, worker: str, tenure_start: int) -> int:
        """The last step of the newest window taken in of ``worker`` in the tenure starting
        at ``tenure_start`` (-1: none): an older window would be ignored (``observe``), so
        a reader need not make one."""
        track = self._tracks.get(worker)
        return track.last if track is not None and track.tenure_start == tenure_start else -1

    def keep_only(self, workers: set[str]) -> None:
        """Workers that left their roles (migrated, failed) take their history with them:
        they are no one's peers any more."""
        for w in [w for w in self._tracks if w not in workers]:
            self._tracks.pop(w, None)

    def observe(self, windows: list[Window]) -> list[Verdict]:
        """Feed windows (a worker's recent ones; one seen before is ignored); returns a
        verdict for every new window judged, in step order. All of a call's windows are
        taken in before any is judged, so a window is compared with its peers' windows of
        the same steps when they came in the same call."""
        fresh = []
        for w in sorted(windows, key=lambda x: (x.worker, x.last)):
            track = self._tracks.get(w.worker)
            if track is None or track.tenure_start != w.tenure_start:
                track = self._tracks[w.worker] = _Track(w.tenure_start)
            if w.last <= track.last:
                continue
            index, track.last = track.seen, w.last
            track.seen += 1
            if self.s.settle_windows <= index < self.s.settle_windows + self.s.baseline_windows:
                track.baseline.append(w.compute_s)
            # enough to find a peer's window within two windows of any being judged
            _keep_last(track.recent, (index, w.last, w.compute_s), self.s.min_windows + 4)
            track.position = (w.role.pp, w.role.tp)
            fresh.append((index, w))
        out = []
        # judging changes no track's windows, so who is whose peer is settled once per call
        peers = _Peers(self._tracks, self.s)
        for index, w in sorted(fresh, key=lambda x: (x[1].last, x[1].worker)):
            verdict = self._judge(index, w, peers)
            if verdict is not None:
                out.append(verdict)
        return out

    def _judge(self, index: int, w: Window, peers: _Peers) -> Verdict | None:
        track = self._tracks[w.worker]
        if index < self.s.settle_windows:
            return None
        ref, kind = peers.reference(w.worker, w.role, w.last), "peers"
        if ref is None:
            if index < self.s.settle_windows + self.s.baseline_windows:
                return None    # the baseline is still being taken
            ref, kind = median(track.baseline), "baseline"
        own = w.compute_s
        if own <= 0 or ref <= 0:
            return None
        _keep_last(track.ratios, own / ref, self.s.min_windows)
        track.slow = track.slow + 1 if own >= (1.0 + self.s.min_shift) * ref else 0
        typical = median(track.ratios) if len(track.ratios) == self.s.min_windows else 1.0
        # hysteresis: a straggler stays one until it is clearly back (half the shift), so a
        # worker near the threshold is not reported, cleared and reported again
        bar = 1.0 + (self.s.min_shift / 2 if track.straggler else self.s.min_shift)
        track.straggler = typical >= bar
        return Verdict(w.worker, w.role.name, round(1.0 / median(track.ratios), 4), kind,
                       track.slow,
                       track.straggler, own - ref, w.last)


class _Peers:
    """The peers' windows a judged window is compared with, by peer position (pipeline stage,
    tensor shard) and the step the window ends at: each position's values are collected and
    sorted once per step, and a worker's reference is their median without its own value,
    where asking every worker about every judged window cost O(N^2) per evaluation."""

    def __init__(self, tracks: dict[str, _Track], settings: DetectorSettings):
        self.tracks, self.s = tracks, settings
        self.at: dict[tuple[int, int], list[str]] = {}   # peer position -> workers there
        for name, track in tracks.items():
            if track.recent:
                self.at.setdefault(track.position, []).append(name)
        # (position, step) -> the values there, sorted, and each worker's own (None: none)
        self._seen: dict[tuple[tuple[int, int], int],
                         tuple[list[float], dict[str, float | None]]] = {}

    def _nearest(self, track: _Track, last: int) -> float | None:
        """The track's settled window nearest the steps ending at ``last`` (at most two
        windows away; the older one on a tie), as its compute seconds."""
        near = [(abs(end - last), compute_s) for i, end, compute_s in track.recent
                if i >= self.s.settle_windows and abs(end - last) <= 2 * self.s.window]
        return min(near, key=lambda x: x[0])[1] if near else None

    def reference(self, worker: str, role: Role, last: int) -> float | None:
        """The median of the windows nearest ``last`` of ``role``'s peers but ``worker``
        (None: no peer has one)."""
        key = ((role.pp, role.tp), last)
        if key not in self._seen:
            each = {n: self._nearest(self.tracks[n], last) for n in self.at.get(key[0], ())}
            self._seen[key] = sorted(v for v in each.values() if v is not None), each
        values, each = self._seen[key]
        # the worker's own value is left out (it has none here if its newest window is in
        # another position)
        return _median_without(values, each.get(worker))


def _median_without(values: list[float], drop: float | None) -> float | None:
    """``statistics.median`` of the sorted ``values`` less one value equal to ``drop`` (if
    not None; it is one of them), in O(log n), with the same arithmetic."""
    n = len(values) - (drop is not None)
    if n == 0:
        return None
    gap = bisect_left(values, drop) if drop is not None else n

    def at(k: int) -> float:
        return values[k + (k >= gap)]
    return at(n // 2) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2


def worth_moving(excess_s_per_step: float, steps_left: int, migration_cost_s: float) -> bool:
    """The cost rule: move a straggler only if staying slow until the job's next natural
    boundary (here its end: ``steps_left`` steps) costs more time than a migration does.
    The job's step is set by its slowest worker, so each step costs about ``excess_s``."""
    return excess_s_per_step * max(steps_left, 0) > migration_cost_s
