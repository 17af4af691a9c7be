"""Planning and straggler detection at scale (issue #24) decide exactly what they decided
before: the arithmetic group lookups, the role index of a membership and the per-position
peer medians are checked, on random small layouts, memberships, requests and measurements,
against straightforward references of the old algorithms kept here (whole-layout group
lists, a pass over every worker per question, every peer asked per judged window)."""
from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field
from statistics import median

import pytest
from hypothesis import given, settings, strategies as st

from trainmover.core import decisions as C
from trainmover.core.stragglers import DetectorSettings, StragglerDetector, Verdict, Window
from trainmover.core.topology import GroupSpec, Layout, Role

AXIS = st.integers(1, 6)


# --- references: the old algorithms, written out plainly ----------------------------------

def ref_roles(layout: Layout) -> list[Role]:
    return [Role(d, p, t) for d in range(layout.dp) for p in range(layout.pp)
            for t in range(layout.tp)]


def ref_groups_of(layout: Layout, role: Role) -> list[GroupSpec]:
    roles = ref_roles(layout)
    d, p, t = role.dp, role.pp, role.tp

    def members(same, order):
        return tuple(sorted((r for r in roles if same(r)), key=order))
    out = [GroupSpec(f"tp.dp{d}.pp{p}", "tp",
                     members(lambda r: (r.dp, r.pp) == (d, p), lambda r: r.tp)),
           GroupSpec(f"dp.pp{p}.tp{t}", "dp",
                     members(lambda r: (r.pp, r.tp) == (p, t), lambda r: r.dp)),
           GroupSpec(f"pp.dp{d}.tp{t}", "pp",
                     members(lambda r: (r.dp, r.tp) == (d, t), lambda r: r.pp))]
    if p > 0:
        out.append(GroupSpec(f"p2p.dp{d}.tp{t}.pp{p - 1}-{p}", "p2p", (Role(d, p - 1, t), role)))
    if p < layout.pp - 1:
        out.append(GroupSpec(f"p2p.dp{d}.tp{t}.pp{p}-{p + 1}", "p2p", (role, Role(d, p + 1, t))))
    return out


@functools.lru_cache(maxsize=None)
def _ref_all_groups(dp: int, pp: int, tp: int) -> tuple[tuple[str, GroupSpec], ...]:
    layout = Layout(dp, pp, tp)
    out: dict[str, GroupSpec] = {}
    for role in ref_roles(layout):
        for spec in ref_groups_of(layout, role):
            out[spec.name] = spec
    return tuple(out.items())


def ref_all_groups(layout: Layout) -> dict[str, GroupSpec]:
    return dict(_ref_all_groups(layout.dp, layout.pp, layout.tp))


def ref_comm_groups(layout: Layout) -> dict[str, GroupSpec]:
    return {n: g for n, g in ref_all_groups(layout).items() if len(g.members) > 1}


def ref_affected(layout: Layout, roles: list[Role]) -> dict[str, GroupSpec]:
    out = {}
    for role in roles:
        for spec in ref_groups_of(layout, role):
            if len(spec.members) > 1:
                out[spec.name] = spec
    return dict(sorted(out.items()))


def ref_members(m: C.Membership, groups: dict, exclude: set[str]) -> dict[str, list[str]]:
    out = {}
    for w, role in m.workers.items():
        if w in exclude:
            continue
        mine = sorted(n for n, g in groups.items() if role in g.members)
        if mine:
            out[w] = mine
    return out


def ref_replica_of(m: C.Membership, role: Role, exclude: set[str]) -> str | None:
    if m.layout.dp_sharded:
        return None
    for w, r in sorted(m.workers.items(), key=lambda kv: kv[1]):
        if w not in exclude and r.pp == role.pp and r.tp == role.tp and r.dp != role.dp:
            return w
    return None


def ref_free(m: C.Membership, busy: set[str]) -> list[str]:
    rank = {C.StandbyState.WARM: 0, C.StandbyState.WARMING: 1, C.StandbyState.COLD: 2,
            C.StandbyState.STARTING: 3}

    def natural(name):
        digits = "".join(c for c in name if c.isdigit())
        return (name.rstrip("0123456789"), int(digits) if digits else -1)
    free = sorted((s for s, st_ in m.standbys.items() if st_ in rank),
                  key=lambda s: (rank[m.standbys[s]], natural(s)))
    return [s for s in free if s not in busy]


def ref_plan_migration(m, mid, leavers, targets, busy, rebuild_all) -> C.MigrationPlan | None:
    """The old plan of a request whose workers are all active and not busy (None: refused
    for want of a free standby)."""
    free = ref_free(m, busy)
    if targets:
        joiners = list(targets)
    elif len(free) < len(leavers):
        return None
    else:
        joiners = free[:len(leavers)]
    pairs = [C.Pair(w, j, m.workers[w]) for w, j in zip(leavers, joiners)]
    affected = ref_comm_groups(m.layout) if rebuild_all else \
        ref_affected(m.layout, [p.role for p in pairs])
    return C.MigrationPlan(mid, pairs, {n: m.next_generation[n] for n in affected},
                           ref_members(m, affected, set(leavers)),
                           len(ref_comm_groups(m.layout)), rebuild_all)


def ref_plan_recovery(m, rid, failed, dirty, ckpt, busy, snap) -> C.RecoveryPlan:
    if not failed:
        raise ValueError("no failed worker given")
    unknown = [w for w in failed if w not in m.workers]
    if unknown:
        raise ValueError(f"failed worker(s) {unknown} hold no role")
    free = ref_free(m, busy)
    if len(free) < len(failed):
        raise C.RecoveryImpossible(f"{len(failed)} failed worker(s) but {len(free)} free "
                                   f"standby")
    pairs = [C.Pair(w, j, m.workers[w]) for w, j in zip(failed, free)]
    dead = set(failed)
    sources = {}
    for p in pairs:
        replica = ref_replica_of(m, p.role, dead)
        sources[p.role.name] = f"replica:{replica}" if replica else "checkpoint"
    rollback = rollback_source = None
    if any(src == "checkpoint" for src in sources.values()):
        if ckpt is None and snap is None:
            raise C.RecoveryImpossible(
                f"role(s) {C.listed(r for r, s in sources.items() if s == 'checkpoint')} have "
                f"no live data-parallel replica and there is no complete snapshot or "
                f"checkpoint")
        if snap is not None and (ckpt is None or snap >= ckpt):
            rollback, rollback_source = snap, "snapshot"
        else:
            rollback, rollback_source = ckpt, "checkpoint"
        sources = {r: rollback_source for r in sources}
    rebuild = dict(ref_affected(m.layout, [p.role for p in pairs]))
    comm = ref_comm_groups(m.layout)
    for name in sorted(dirty):
        if name in comm:
            rebuild[name] = comm[name]
    return C.RecoveryPlan(rid, pairs, sources, rollback,
                          {n: m.next_generation[n] for n in rebuild},
                          ref_members(m, rebuild, dead), len(comm), rollback_source)


def ref_dirty_groups(layout, reports, holders) -> set[str]:
    dirty = set()
    role_holder = {r: w for w, r in holders.items()}
    for name, spec in ref_comm_groups(layout).items():
        members = [role_holder.get(r) for r in spec.members]
        if any(w is None or w not in reports or name not in reports[w] for w in members):
            continue
        acc = [reports[w][name] for w in members]
        if any(a["pending"] for a in acc) or len({a["generation"] for a in acc}) > 1:
            dirty.add(name)
        elif len({a["coll"] for a in acc}) > 1:
            dirty.add(name)
        elif spec.kind == "p2p" and (acc[0]["sent"] != acc[1]["recv"] or
                                     acc[1]["sent"] != acc[0]["recv"]):
            dirty.add(name)
    return dirty


# --- random memberships ------------------------------------------------------------------

BOGUS = ["", "tp", "tp.dp0", "tp.dp01.pp0", "dp.pp0.tp0.dp1", "p2p.dp0.tp0.pp0-2",
         "p2p.dp0.tp0.pp1-0", "tp.dp99.pp0", "pp.dp0.tp99", "xfer.w0.s0", "dp.pp٠.tp0",
         "tp.dp" + "9" * 30 + ".pp0"]


@st.composite
def memberships(draw) -> C.Membership:
    layout = Layout(draw(AXIS), draw(AXIS), draw(AXIS), dp_sharded=draw(st.booleans()))
    rng = draw(st.randoms(use_true_random=False))
    roles = ref_roles(layout)
    rng.shuffle(roles)
    workers = {f"w{i}": r for i, r in enumerate(roles)}
    departed = []
    # earlier migrations: a joiner holds the role now, at the end of the table
    for k in range(draw(st.integers(0, 3))):
        leaver = rng.choice(sorted(workers))
        workers[f"j{k}"] = workers.pop(leaver)
        departed.append(leaver)
    states = list(C.StandbyState)
    standbys = {f"s{i}": rng.choice(states) for i in range(draw(st.integers(0, 6)))}
    names = list(ref_comm_groups(layout))
    gens = {n: rng.randint(0, 4) for n in names}
    return C.Membership(layout, workers, standbys, gens,
                        {n: g + rng.randint(1, 3) for n, g in gens.items()}, departed)


def same_plan(new, ref) -> None:
    assert new == ref
    # the dataclass equality ignores dict order: the groups keep theirs (affected ones sorted,
    # then the dirty ones; the naive plan's in layout order); the stayers' order is free
    assert list(new.generations) == list(ref.generations)


# --- topology ----------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(AXIS, AXIS, AXIS)
def test_group_lists_are_the_old_ones_in_the_old_order(dp, pp, tp):
    layout = Layout(dp, pp, tp)
    assert list(layout.all_groups().items()) == list(ref_all_groups(layout).items())
    assert list(layout.communicator_groups().items()) == list(ref_comm_groups(layout).items())
    assert layout.communicator_group_count() == len(ref_comm_groups(layout))
    for name, spec in ref_all_groups(layout).items():
        assert layout.group(name) == spec
    for name in BOGUS + [f"{k}.dp{dp}.pp0.tp0" for k in ("tp", "dp", "pp", "p2p")]:
        assert layout.group(name) is None, name
    for role in ref_roles(layout):
        assert layout.affected_groups(role) == ref_affected(layout, [role])


# --- planning ----------------------------------------------------------------------------

@settings(max_examples=150, deadline=None)
@given(memberships(), st.data())
def test_plan_migration_is_the_old_plan(m, data):
    workers = sorted(m.workers)
    leavers = data.draw(st.lists(st.sampled_from(workers), min_size=1, max_size=4,
                                 unique=True))
    busy = set(data.draw(st.lists(st.sampled_from(sorted(m.standbys) or ["-"]), max_size=2)))
    free = ref_free(m, busy)
    targets = None
    if len(free) >= len(leavers) and data.draw(st.booleans()):
        targets = data.draw(st.permutations(free))[:len(leavers)]
    rebuild_all = data.draw(st.booleans())
    before = copy.deepcopy(m)
    ref = ref_plan_migration(m, 7, leavers, targets, busy, rebuild_all)
    if ref is None:
        with pytest.raises(C.MigrationRefused, match="no free standby"):
            C.plan_migration(m, 7, leavers, targets, busy, rebuild_all)
    else:
        same_plan(C.plan_migration(m, 7, leavers, targets, busy, rebuild_all), ref)
    assert m == before


@settings(max_examples=150, deadline=None)
@given(memberships(), st.data())
def test_plan_recovery_is_the_old_plan(m, data):
    workers = sorted(m.workers)
    failed = data.draw(st.lists(st.sampled_from(workers + ["ghost"]), max_size=4, unique=True))
    names = list(ref_all_groups(m.layout)) + BOGUS
    dirty = set(data.draw(st.lists(st.sampled_from(names), max_size=6)))
    steps = st.none() | st.integers(0, 50)
    ckpt, snap = data.draw(steps), data.draw(steps)
    busy = set(data.draw(st.lists(st.sampled_from(sorted(m.standbys) or ["-"]), max_size=2)))
    try:
        ref = ref_plan_recovery(m, 3, failed, dirty, ckpt, busy, snap)
    except (ValueError, C.RecoveryImpossible) as exc:
        with pytest.raises(type(exc)) as err:
            C.plan_recovery(m, 3, failed, dirty, ckpt, busy, snap)
        assert str(err.value) == str(exc)
        return
    same_plan(C.plan_recovery(m, 3, failed, dirty, ckpt, busy, snap), ref)
    for w in failed:
        assert C.replica_of(m, m.workers[w], set(failed)) == \
            ref_replica_of(m, m.workers[w], set(failed))


@settings(max_examples=80, deadline=None)
@given(memberships(), st.data())
def test_plans_follow_a_table_changed_in_place(m, data):
    """The membership's role index is a hint: planning after ``workers`` was edited directly
    (not through commit) answers from the table as it is now."""
    if len(m.workers) < 2:
        return
    if ref_free(m, set()):   # a first plan fills the index
        C.plan_recovery(m, 1, [sorted(m.workers)[0]], set(), 5, snapshot_step=5)
    a, b = data.draw(st.lists(st.sampled_from(sorted(m.workers)), min_size=2, max_size=2,
                              unique=True))
    m.workers[a], m.workers[b] = m.workers[b], m.workers[a]
    role = m.workers.pop(a)
    m.workers["late"] = role
    for w in sorted(m.workers)[:3]:
        assert C.replica_of(m, m.workers[w], {w}) == ref_replica_of(m, m.workers[w], {w})
        ref = ref_plan_migration(m, 2, [w], None, set(), False)
        if ref is not None:
            same_plan(C.plan_migration(m, 2, [w]), ref)


@settings(max_examples=100, deadline=None)
@given(memberships(), st.data())
def test_dirty_groups_are_the_old_verdicts(m, data):
    rng = data.draw(st.randoms(use_true_random=False))
    failed = set(data.draw(st.lists(st.sampled_from(sorted(m.workers)), max_size=2)))
    holders = {w: r for w, r in m.workers.items() if w not in failed}
    reports = {}
    for w, role in m.workers.items():
        if w in failed and rng.random() < 0.7:
            continue
        # trivial groups and names of no group are reported too: neither is ever dirty
        mine = [g.name for g in ref_groups_of(m.layout, role) if rng.random() < 0.95]
        mine += rng.sample(BOGUS, 1)
        reports[w] = {g: {"coll": rng.choice((3, 3, 3, 4)), "sent": rng.choice((2, 2, 3)),
                          "recv": rng.choice((2, 2, 3)), "pending": rng.random() < 0.05,
                          "generation": rng.choice((0, 0, 0, 1))} for g in mine}
    assert C.dirty_groups(m.layout, reports, holders) == \
        ref_dirty_groups(m.layout, reports, holders)


@settings(max_examples=80, deadline=None)
@given(memberships(), st.data())
def test_reserve_commit_abort_are_the_old_copies(m, data):
    free = ref_free(m, set())
    if not free:
        return
    leavers = data.draw(st.lists(st.sampled_from(sorted(m.workers)), min_size=1,
                                 max_size=min(len(free), 3), unique=True))
    plan = C.plan_migration(m, 1, leavers)
    dead = set(data.draw(st.lists(st.sampled_from(plan.joiners), max_size=2)))
    for step, old in ((C.reserve, _ref_reserve), (C.commit, _ref_commit)):
        assert step(m, plan) == old(m, plan)
    assert C.abort(m, plan, dead) == _ref_abort(m, plan, dead)
    before = copy.deepcopy(m)
    out = C.commit(C.reserve(m, plan), plan)
    out.workers.clear(), out.standbys.clear(), out.generations.clear(), out.departed.clear()
    out.next_generation.clear()
    assert m == before   # the copies share no container with the original
    after = C.commit(m, plan)
    for p in plan.pairs:   # the committed table answers for the joiners at once
        assert after.holder(p.role) == p.joiner
        assert after.holder(p.role) == next(w for w, r in after.workers.items() if r == p.role)


def _ref_reserve(m, plan):
    out = copy.deepcopy(m)
    for j in plan.joiners:
        out.standbys[j] = C.StandbyState.RESERVED
    for name, gen in plan.generations.items():
        out.next_generation[name] = gen + 1
    return out


def _ref_commit(m, plan):
    out = copy.deepcopy(m)
    for p in plan.pairs:
        del out.workers[p.leaver]
        out.workers[p.joiner] = p.role
        out.standbys.pop(p.joiner, None)
        out.departed.append(p.leaver)
    out.generations.update(plan.generations)
    return out


def _ref_abort(m, plan, dead):
    out = copy.deepcopy(m)
    for j in plan.joiners:
        if j in out.standbys:
            out.standbys[j] = C.StandbyState.DEAD if j in dead else C.StandbyState.COLD
    return out


# --- straggler detection -----------------------------------------------------------------

@dataclass
class _RefTrack:
    tenure_start: int
    last: int = -1
    seen: int = 0
    baseline: list = field(default_factory=list)
    recent: list = field(default_factory=list)
    ratios: list = field(default_factory=list)
    slow: int = 0
    straggler: bool = False


class RefDetector:
    """The old detector: every judged window asks every other worker for its window."""

    def __init__(self, s: DetectorSettings):
        self.s, self.tracks = s, {}

    def keep_only(self, workers):
        for w in [w for w in self.tracks if w not in workers]:
            self.tracks.pop(w, None)

    def observe(self, windows):
        fresh = []
        for w in sorted(windows, key=lambda x: (x.worker, x.last)):
            track = self.tracks.get(w.worker)
            if track is None or track.tenure_start != w.tenure_start:
                track = self.tracks[w.worker] = _RefTrack(w.tenure_start)
            if w.last <= track.last:
                continue
            index, track.last = track.seen, w.last
            track.seen += 1
            if self.s.settle_windows <= index < self.s.settle_windows + self.s.baseline_windows:
                track.baseline.append(w.compute_s)
            track.recent = (track.recent + [(index, w)])[-(self.s.min_windows + 4):]
            fresh.append((index, w))
        out = []
        for index, w in sorted(fresh, key=lambda x: (x[1].last, x[1].worker)):
            v = self.judge(index, w)
            if v is not None:
                out.append(v)
        return out

    def peer_window(self, track, w):
        near = [(abs(p.last - w.last), p) for i, p in track.recent
                if i >= self.s.settle_windows and abs(p.last - w.last) <= 2 * self.s.window]
        return min(near, key=lambda x: x[0])[1] if near else None

    def judge(self, index, w):
        track = self.tracks[w.worker]
        if index < self.s.settle_windows:
            return None
        peers = []
        for name, other in self.tracks.items():
            if name == w.worker or not other.recent:
                continue
            role = other.recent[-1][1].role
            if role.pp == w.role.pp and role.tp == w.role.tp:
                p = self.peer_window(other, w)
                if p is not None:
                    peers.append(p.compute_s)
        if peers:
            ref, kind = median(peers), "peers"
        else:
            if index < self.s.settle_windows + self.s.baseline_windows:
                return None
            ref, kind = median(track.baseline), "baseline"
        own = w.compute_s
        if own <= 0 or ref <= 0:
            return None
        track.ratios = (track.ratios + [own / ref])[-self.s.min_windows:]
        track.slow = track.slow + 1 if own >= (1.0 + self.s.min_shift) * ref else 0
        typical = median(track.ratios) if len(track.ratios) == self.s.min_windows else 1.0
        bar = 1.0 + (self.s.min_shift / 2 if track.straggler else self.s.min_shift)
        track.straggler = typical >= bar
        return Verdict(w.worker, w.role.name, round(1.0 / median(track.ratios), 4), kind,
                       track.slow, track.straggler, own - ref, w.last)


# few distinct values, so ties and equal medians are common; 0 and below are never judged
COMPUTE = st.sampled_from([0.0, -0.1, 0.1, 0.1, 0.1, 0.115, 0.12, 0.13, 0.2, 0.35, 1.0]) | \
    st.floats(0.001, 2.0)


@settings(max_examples=120, deadline=None)
@given(st.integers(1, 5), st.integers(1, 3), st.integers(1, 2), st.data())
def test_straggler_verdicts_are_the_old_ones(dp, pp, tp, data):
    rng = data.draw(st.randoms(use_true_random=False))
    s = DetectorSettings(window=data.draw(st.sampled_from([1, 2, 4, 8])),
                         min_shift=data.draw(st.sampled_from([0.0, 0.1, 0.15, 0.5])),
                         min_windows=data.draw(st.integers(1, 5)),
                         settle_windows=data.draw(st.integers(0, 3)),
                         baseline_windows=data.draw(st.integers(1, 3)))
    values = data.draw(st.lists(COMPUTE, min_size=1, max_size=12))
    holders = {f"w{i}": r for i, r in enumerate(Layout(dp, pp, tp).roles())}
    tenure = dict.fromkeys(holders, 0)
    offset = dict.fromkeys(holders, 0)   # a joiner's windows start at its own first step
    history: dict[str, list[Window]] = {w: [] for w in holders}
    new, old = StragglerDetector(s), RefDetector(s)
    joiners = 0
    for k in range(data.draw(st.integers(1, 14))):
        if rng.random() < 0.1:   # a migration: a joiner takes a role, a new tenure begins
            leaver = rng.choice(sorted(holders))
            joiner = f"j{joiners}"
            joiners += 1
            holders[joiner] = holders.pop(leaver)
            tenure[joiner], offset[joiner] = k * s.window, rng.choice((0, 0, 1))
            history[joiner] = []
        batch = []
        for w, role in holders.items():
            if rng.random() < 0.1:
                continue   # this worker's measurement is late this time
            first = k * s.window + offset.get(w, 0)
            history[w].append(Window(w, role, first, first + s.window - 1, tenure[w],
                                     rng.choice(values)))
            # the message carries the worker's recent windows: some seen before
            batch += history[w][-rng.randint(1, 3):]
        if rng.random() < 0.3:
            continue   # the controller reads less often than a window passes
        new.keep_only(set(holders))
        old.keep_only(set(holders))
        rng.shuffle(batch)
        assert new.observe(batch) == old.observe(list(batch))
