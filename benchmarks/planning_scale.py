"""How the controller's planning and straggler detection scale with the number of workers
(issue #24): the code of a git revision ("before", HEAD by default, loaded from git into
stand-alone modules) against the working tree ("after"), at N = 1K, 4K, 16K, 64K workers in
two layouts: DP = N/64 x PP8 x TP8 and DP = N x PP1 x TP1. Each cell: the median of REPEATS
runs, with min and max, in seconds. A cell whose run would take more than BUDGET seconds
(extrapolated quadratically from the previous size) is skipped and marked so.

    nice -n 19 .venv/bin/python benchmarks/planning_scale.py [--before REV] [--repeats 3]
        [--budget 30] [--sizes 1024,4096,16384,65536] [--only after]

What is timed, per event (each on a fresh membership of N workers and 8 warm standbys):
- communicator_groups: every group of the layout (once per job: Membership.initial);
- affected_groups: the groups of one role;
- plan_migration / plan_recovery: one worker (a middle one) leaving / failing, on the table
  as the controller keeps it; "(cold)": on a table just read back from a snapshot, whose
  role index the first plan builds (once, O(N));
- reserve+commit: the membership copies a migration makes;
- dirty_groups: judging every survivor's accounting after an aborted step;
- stragglers: one evaluation of N fresh windows (after the settling windows)."""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def load_revision(rev: str) -> dict[str, types.ModuleType]:
    """topology, decisions and stragglers of ``rev`` as modules of their own (imports between
    them rewired), so both versions run in one process."""
    out: dict[str, types.ModuleType] = {}
    for short in ("topology", "decisions", "stragglers"):
        src = subprocess.run(["git", "show", f"{rev}:trainmover/core/{short}.py"], cwd=ROOT,
                             check=True, capture_output=True, text=True).stdout
        src = src.replace("from trainmover.core.topology import",
                          "from _before_topology import")
        name = f"_before_{short}"
        mod = types.ModuleType(name)
        mod.__file__ = f"<{rev}:{short}.py>"
        sys.modules[name] = mod   # dataclasses look their module up while decorating
        exec(compile(src, mod.__file__, "exec"), mod.__dict__)
        out[short] = mod
    return out


def load_tree() -> dict[str, types.ModuleType]:
    from trainmover.core import decisions, stragglers, topology
    return {"topology": topology, "decisions": decisions, "stragglers": stragglers}


def comm_group_names(dp: int, pp: int, tp: int) -> list[str]:
    """Every communicator group's name, by arithmetic: both versions name them alike, and the
    old code would take hours to list them at the largest sizes."""
    names = [f"tp.dp{d}.pp{p}" for d in range(dp) for p in range(pp)] if tp > 1 else []
    names += [f"dp.pp{p}.tp{t}" for p in range(pp) for t in range(tp)] if dp > 1 else []
    names += [f"pp.dp{d}.tp{t}" for d in range(dp) for t in range(tp)] if pp > 1 else []
    names += [f"p2p.dp{d}.tp{t}.pp{p}-{p + 1}" for d in range(dp) for t in range(tp)
              for p in range(pp - 1)]
    return names


def role_group_names(shape: tuple[int, int, int], role) -> list[str]:
    """The communicator groups of one role, by name (as ``comm_group_names``)."""
    dp, pp, tp = shape
    d, p, t = role.dp, role.pp, role.tp
    out = [f"tp.dp{d}.pp{p}"] if tp > 1 else []
    out += [f"dp.pp{p}.tp{t}"] if dp > 1 else []
    out += [f"pp.dp{d}.tp{t}"] if pp > 1 else []
    out += [f"p2p.dp{d}.tp{t}.pp{p - 1}-{p}"] if p > 0 else []
    out += [f"p2p.dp{d}.tp{t}.pp{p}-{p + 1}"] if p < pp - 1 else []
    return out


class Case:
    """One layout of N workers in one version's classes."""

    def __init__(self, mods: dict, dp: int, pp: int, tp: int):
        T, C = mods["topology"], mods["decisions"]
        self.T, self.C, self.S = T, C, mods["stragglers"]
        self.layout = T.Layout(dp, pp, tp)
        n = self.layout.num_roles
        names = comm_group_names(dp, pp, tp)
        self.workers = {f"w{i}": self.layout.role_of(i) for i in range(n)}
        self.membership = C.Membership(
            layout=self.layout, workers=dict(self.workers),
            standbys={f"s{i}": C.StandbyState.WARM for i in range(8)},
            generations={g: 0 for g in names}, next_generation={g: 1 for g in names})
        self.victim = f"w{n // 2 + tp // 2}"
        self.role = self.workers[self.victim]
        if hasattr(self.membership, "holder"):
            self.membership.holder(self.role)   # the controller's table has its index built

    def fresh(self, cold: bool = False):
        """A copy of the table to plan on, as the controller holds it (its role index built,
        where there is one); ``cold``: as just read back from a snapshot (no index yet)."""
        m = self.membership
        if hasattr(m, "copy") and not cold:
            return m.copy()
        return self.C.Membership(layout=m.layout, workers=dict(m.workers),
                                 standbys=dict(m.standbys), generations=dict(m.generations),
                                 next_generation=dict(m.next_generation))

    def plan(self):
        """The victim's migration plan, written out (the old planner takes minutes at 64K)."""
        shape = (self.layout.dp, self.layout.pp, self.layout.tp)
        names = role_group_names(shape, self.role)
        return self.C.MigrationPlan(1, [self.C.Pair(self.victim, "s0", self.role)],
                                    {g: 1 for g in names}, {}, len(names))

    def reports(self) -> tuple[dict, dict]:
        """Every survivor's (clean) accounting of its groups, and the holders."""
        holders = {w: r for w, r in self.workers.items() if w != self.victim}
        acc = {"coll": 3, "sent": 2, "recv": 2, "pending": 0, "generation": 0}
        shape = (self.layout.dp, self.layout.pp, self.layout.tp)
        reports = {w: {g: acc for g in role_group_names(shape, r)} for w, r in holders.items()}
        return reports, holders


def windows(case: Case, detector, k: int) -> list:
    """Every worker's k-th window of measurements (a few distinct values, as noise gives)."""
    win, S = detector.s.window, case.S
    return [S.Window(w, r, k * win, k * win + win - 1, 0, 0.1 + (i % 7) * 1e-3)
            for i, (w, r) in enumerate(case.workers.items())]


def time_op(case: Case, op: str, repeats: int) -> list[float]:
    C = case.C
    times = []
    if op == "stragglers":
        detector = case.S.StragglerDetector(case.S.DetectorSettings())
        # the settling windows are not judged against peers: cheap in both versions
        detector.observe(windows(case, detector, 0) + windows(case, detector, 1))
    if op == "dirty_groups":
        reports, holders = case.reports()
    for k in range(repeats):
        m = case.fresh(cold=op.endswith("(cold)"))
        gc.collect()
        t0 = time.perf_counter()
        if op == "communicator_groups":
            case.layout.communicator_groups()
        elif op == "affected_groups":
            case.layout.affected_groups(case.role)
        elif op.startswith("plan_migration"):
            C.plan_migration(m, 1, [case.victim])
        elif op == "plan_recovery":
            C.plan_recovery(m, 1, [case.victim], set(), 10)
        elif op == "reserve+commit":
            plan = case.plan()
            t0 = time.perf_counter()
            C.commit(C.reserve(m, plan), plan)
        elif op == "dirty_groups":
            C.dirty_groups(case.layout, reports, holders)
        elif op == "stragglers":
            new = windows(case, detector, 2 + k)
            t0 = time.perf_counter()
            detector.observe(new)
        times.append(time.perf_counter() - t0)
    return times


OPS = ("communicator_groups", "affected_groups", "plan_migration", "plan_migration (cold)",
       "plan_recovery",
       "reserve+commit", "dirty_groups", "stragglers")


def cell(times: list[float] | None, est: float | None) -> str:
    if times is None:
        return f"skipped (est. > {est:.0f} s)" if est is not None else "-"
    med = statistics.median(times)
    return f"{fmt(med)} ({fmt(min(times))}-{fmt(max(times))})"


def fmt(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:.0f} us"
    if s < 1:
        return f"{s * 1e3:.1f} ms"
    return f"{s:.2f} s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", default="HEAD", help="git revision of the 'before' code")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget", type=float, default=30.0,
                    help="skip a cell whose single run would exceed this many seconds")
    ap.add_argument("--sizes", default="1024,4096,16384,65536")
    ap.add_argument("--only", choices=("before", "after"), default=None)
    ap.add_argument("--ops", default=",".join(OPS))
    args = ap.parse_args()
    versions = {}
    if args.only != "after":
        versions["before"] = load_revision(args.before)
    if args.only != "before":
        versions["after"] = load_tree()
    sizes = [int(s) for s in args.sizes.split(",")]
    ops = args.ops.split(",")
    shapes = [("PP8xTP8", 8, 8), ("PP1xTP1", 1, 1)]
    rows = []
    last: dict[tuple, tuple[int, float]] = {}
    for shape, pp, tp in shapes:
        for n in sizes:
            cases = {v: Case(mods, n // (pp * tp), pp, tp) for v, mods in versions.items()}
            for op in ops:
                row = {"op": op, "layout": f"DP{n // (pp * tp)}x{shape}", "n": n}
                for v, case in cases.items():
                    key = (v, shape, op)
                    est = None
                    if key in last:
                        n0, t0 = last[key]
                        est = t0 * (n / n0) ** 2
                    if est is not None and est > args.budget:
                        row[v] = (None, est)
                        continue
                    times = time_op(case, op, args.repeats)
                    last[key] = (n, max(times))
                    row[v] = (times, None)
                    print(f"# {op} {row['layout']} N={n} {v}: {cell(times, None)}",
                          file=sys.stderr, flush=True)
                rows.append(row)
    head = ["operation", "layout", "N"] + [f"{v} median (min-max)" for v in versions]
    if len(versions) == 2:
        head.append("speed-up")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in rows:
        line = [row["op"], row["layout"], str(row["n"])]
        line += [cell(*row[v]) for v in versions]
        if len(versions) == 2:
            b, a = row["before"][0], row["after"][0]
            line.append(f"{statistics.median(b) / statistics.median(a):.0f}x"
                        if b and a and statistics.median(a) > 0 else "")
        print("| " + " | ".join(line) + " |")


if __name__ == "__main__":
    main()
