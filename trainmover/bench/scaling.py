"""The control plane's costs as functions of the job's size, for ``trainmover project``.

``trainmover bench control`` measures the control plane (the real store, controller, agents
and worker control code, with simulated compute) at a few worker counts. The projection
needs those costs at 1K-128K GPUs, so it fits each one with a power law ``y = a * N**b``
(least squares on the logarithms of the per-size medians) and says where it goes beyond the
largest size measured. A power law is the plain choice for a cost that grows as some power
of N (a vote that waits for N voters, a controller that sweeps N workers); the fit is shown
with every measured point beside its fitted value, so a reader can judge it, and with two
sizes only it goes through both points and checks nothing, which the table says.

What is fitted (per-size medians over the bench's repeats):
- the step overhead: the mean time a step spends on the control plane beyond its compute
  (``vote_mean_ms``; a result written before it was recorded gives its median, said so):
  charged on every step;
- the crash control path: a crash to all survivors resumed (``crash_to_resumed_s``): its
  growth over the size the per-event costs were measured at is added to each failure;
- the root store's and the controller's CPU share (one thread each, one core at most):
  where a fit reaches 1 the component is saturated, the model no longer holds and the
  row is out of range.
The planned migration's control path is not simulated (``migration_control_s`` is empty in
every result so far): its growth is not counted, and the projection says so.

The simulator shares this machine's two cores among every simulated host, so past ~2K
workers its step overhead is mostly hosts waiting for a core: an upper bound, whose fit
grows steeply. ``benchmarks/vote_hosts.py`` measures what a step's vote costs the one
store (the part that does not spread over the hosts) at up to 12,500 hosts, a lean client
playing the hosts: ``store_vote_from_file`` fits its time from the last vote to every host
holding the decision (votes all sent at once, the longest case) against the workers, for
the projection's column that charges each step that alone: the other bound. Since the
hosts vote in groups (``agent/groupvote.py``), ``benchmarks/vote_groups.py`` measures the
whole vote through them (the critical path, one group real); ``store_vote_from_file`` reads
its grouped rows at the sizes the agent groups at.

Torch-free: it only reads result files.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from trainmover.bench.report import read_result
from trainmover.core.config import VOTE_GROUPS_FROM_HOSTS


@dataclass
class PowerLaw:
    """``y = a * N**b``, fitted on ``points`` (size, measured median), each kept beside its
    fitted value."""
    a: float
    b: float
    points: list          # [[workers, measured, fitted], ...]

    def __call__(self, n: float) -> float:
        return self.a * n ** self.b

    @property
    def n_max(self) -> int:
        return max(p[0] for p in self.points)

    @property
    def n_min(self) -> int:
        return min(p[0] for p in self.points)


def fit_power_law(points: list[tuple[int, float]], what: str) -> PowerLaw:
    """Least squares on ``log y = log a + b log N``. Needs two sizes or more and positive
    values; raises ``ValueError`` naming ``what`` otherwise."""
    sizes = sorted({n for n, _ in points})
    if len(sizes) < 2:
        raise ValueError(f"{what}: measured at {len(sizes)} size(s) ({sizes}); a fit against "
                         f"the number of workers needs two or more (bench control --workers "
                         f"256,1024 or more)")
    bad = [(n, y) for n, y in points if not (y > 0 and math.isfinite(y))]
    if bad:
        raise ValueError(f"{what}: values must be positive to fit a power law, got {bad}")
    xs = [math.log(n) for n, _ in points]
    ys = [math.log(y) for _, y in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = (sum((x - mx) * (y - my) for x, y in zip(xs, ys))
         / sum((x - mx) ** 2 for x in xs))
    a = math.exp(my - b * mx)
    return PowerLaw(a=a, b=b, points=[[n, y, a * n ** b] for n, y in points])


@dataclass
class ControlScaling:
    """The control plane's fitted costs (seconds per step and per crash; CPU shares)."""
    step_overhead_s: PowerLaw
    crash_control_s: PowerLaw
    store_cpu: PowerLaw | None
    controller_cpu: PowerLaw | None
    step_overhead_from: str            # "mean" or "p50" (an older result)
    source: dict = field(default_factory=dict)
    # the store's share of a step's vote alone (``store_vote_from_file``), where given
    store_vote_s: PowerLaw | None = None
    store_vote_source: dict | None = None

    def beyond(self, n: int) -> float | None:
        """How far ``n`` lies beyond the largest size measured (None: inside)."""
        top = min(self.step_overhead_s.n_max, self.crash_control_s.n_max)
        return n / top if n > top else None

    def saturated(self, n: int) -> list[str]:
        """The single-threaded components the fits put at or past a whole core at ``n``."""
        return [name for name, fit in (("root store", self.store_cpu),
                                       ("controller", self.controller_cpu))
                if fit is not None and fit(n) >= 1.0]


def control_from_bench(path: str) -> ControlScaling:
    """Fits over a ``trainmover bench control`` result. Raises ``ValueError`` naming the file
    and what it lacks."""
    data = read_result(path, "--control", "control")
    by_size: dict[int, list[dict]] = {}
    for row in data.get("results", []):
        by_size.setdefault(int(row["workers"]), []).append(row)

    def medians(key: str, scale: float = 1.0) -> list[tuple[int, float]] | None:
        out = []
        for n, rows in sorted(by_size.items()):
            values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
            if not values:
                return None
            out.append((n, scale * statistics.median(values)))
        return out

    step_from = "mean"
    step = medians("vote_mean_ms", 1e-3)
    if step is None:
        step_from, step = "p50", medians("vote_p50_ms", 1e-3)
    crash = medians("crash_to_resumed_s")
    if step is None or crash is None:
        raise ValueError(f"--control {path!r}: no step overhead or crash recovery figures")

    def optional(key: str) -> PowerLaw | None:
        got = medians(key)
        return fit_power_law(got, f"--control {path}: {key}") if got else None

    return ControlScaling(
        step_overhead_s=fit_power_law(step, f"--control {path}: step overhead"),
        crash_control_s=fit_power_law(crash, f"--control {path}: crash to resumed"),
        store_cpu=optional("store_cpu_share"), controller_cpu=optional("controller_cpu_share"),
        step_overhead_from=step_from,
        source={"file": path, "commit": data.get("commit"),
                "compute_s": data.get("settings", {}).get("compute_s"),
                "cores": (data.get("machine") or {}).get("cores"),
                "sim_cpu_share": medians("sim_cpu_share"),
                "repeats": {n: len(rows) for n, rows in sorted(by_size.items())}})


def store_vote_from_file(path: str) -> tuple[PowerLaw, dict]:
    """A step's vote against the workers (seconds): the store's share, fitted over a
    ``benchmarks/vote_hosts.py`` result's rows with every vote sent at once, or the vote
    through vote groups, over a ``benchmarks/vote_groups.py`` result's grouped rows from
    ``VOTE_GROUPS_FROM_HOSTS`` hosts (below, the agent does not group); and where it came
    from. ``ValueError`` naming the file where it cannot serve."""
    try:
        data = read_result(path, "--vote-hosts", "vote_groups")
        rows = [(r, r["grouped"]["all_ms"]) for r in data.get("rows", [])
                if isinstance(r.get("grouped", {}).get("all_ms"), dict) and
                int(r.get("hosts", 0)) >= VOTE_GROUPS_FROM_HOSTS]
        why = f"no grouped rows from {VOTE_GROUPS_FROM_HOSTS} hosts"
    except ValueError:
        data = read_result(path, "--vote-hosts", "vote_hosts")
        rows = [(r, r["all_ms"]) for r in data.get("rows", []) if r.get("spread_ms") == 0 and
                not r.get("wait_get") and not r.get("two_writes") and
                isinstance(r.get("all_ms"), dict)]
        why = ("no rows with the votes sent at once (--spread-ms 0) by the relay as it is "
               "(without --wait-get or --two-writes)")
    if not rows:
        raise ValueError(f"--vote-hosts {path!r}: {why}")
    points = [(int(r["workers"]), ms["median"] / 1000) for r, ms in rows]
    fit = fit_power_law(points, f"--vote-hosts {path}: a step's vote")
    return fit, {"file": path, "commit": data.get("commit"), "benchmark": data["benchmark"],
                 "hosts": sorted(int(r["hosts"]) for r, _ in rows),
                 "voters_per_host": data.get("voters_per_host")}


def fit_words(fit: dict, unit: str, scale: float = 1.0, digits: int = 2) -> str:
    """A fit as written in a result (``asdict(PowerLaw)``): ``a * N^b`` and each measured
    point beside its fitted value, for the table."""
    pts = ", ".join(f"{n:,}: {scale * y:.{digits}f} vs {scale * f:.{digits}f}"
                    for n, y, f in fit["points"])
    exact = " (two sizes: the line goes through both, the form is not checked)" \
        if len({p[0] for p in fit["points"]}) == 2 else ""
    return (f"{scale * fit['a']:.3g} {unit} x N^{fit['b']:.2f} (measured vs fitted: {pts} "
            f"{unit})" + exact)
