"""Controller decisions, as pure functions over the membership table (no processes, no
tensors): which migrations are allowed, who takes part, which groups move to which
generation, and how a migration advances through its states.

The coordinator process owns one ``Membership`` and applies these functions to it; workers
only ever see the resulting commands.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from trainmover.core.codec import Table
from trainmover.core.topology import GroupSpec, Layout, Role


class MigrationRefused(ValueError):
    """A migration request that cannot be carried out; the job is left untouched."""


class StandbyState(str, Enum):
    STARTING = "starting"   # process launched, not registered yet
    COLD = "cold"           # registered, nothing prepared
    WARMING = "warming"
    WARM = "warm"
    RESERVED = "reserved"   # picked as a joiner by an in-flight migration
    DEAD = "dead"


@dataclass
class Membership:
    """Who holds which role, which standbys exist, and each group's current generation."""

    layout: Layout
    workers: dict[str, Role]                      # active workers only
    standbys: dict[str, StandbyState] = field(default_factory=dict)
    generations: dict[str, int] = field(default_factory=dict)   # group name -> live generation
    next_generation: dict[str, int] = field(default_factory=dict)  # never reused, even on abort
    departed: list[str] = field(default_factory=list)
    # role -> holder, so planning reads a group's holders without a pass over every worker.
    # A hint, checked on each use (``workers`` may be changed in place), never saved.
    _holders: dict[Role, str] = field(default_factory=dict, init=False, repr=False,
                                      compare=False)

    def __post_init__(self) -> None:
        # Tables (core/codec.py): the controller's snapshot encodes each again only when it
        # changed; a membership read back from an older snapshot holds plain dicts
        for name in ("workers", "standbys", "generations", "next_generation"):
            if not isinstance(getattr(self, name), Table):
                setattr(self, name, Table(getattr(self, name)))

    @staticmethod
    def initial(layout: Layout, workers: list[str], standbys: list[str]) -> "Membership":
        if len(workers) != layout.num_roles:
            raise ValueError(f"{len(workers)} workers for {layout.num_roles} roles")
        groups = layout.communicator_groups()
        return Membership(
            layout=layout, workers=dict(zip(workers, layout.roles())),
            standbys={s: StandbyState.STARTING for s in standbys},
            generations={n: 0 for n in groups}, next_generation={n: 1 for n in groups})

    def holder(self, role: Role) -> str | None:
        """The active worker holding ``role``, if any: O(1), but for the first use after
        ``workers`` changed in place, and for a role nobody holds (one pass over it)."""
        w = self._holders.get(role)
        if w is None or self.workers.get(w) != role:
            self._holders = {r: name for name, r in self.workers.items()}
            w = self._holders.get(role)
        return w

    def copy(self) -> "Membership":
        """An independent copy. Shallow containers are enough (every value in them is
        immutable: roles, states, numbers, names), and an order of magnitude cheaper than a
        deep copy with tens of thousands of workers."""
        out = Membership(self.layout, Table(self.workers), Table(self.standbys),
                         Table(self.generations), Table(self.next_generation),
                         list(self.departed))
        out._holders = dict(self._holders)
        return out

    def free_standbys(self) -> list[str]:
        """Standbys that may be picked, warm ones first, then by name."""
        rank = {StandbyState.WARM: 0, StandbyState.WARMING: 1, StandbyState.COLD: 2,
                StandbyState.STARTING: 3}
        free = [s for s, st in self.standbys.items() if st in rank]
        return sorted(free, key=lambda s: (rank[self.standbys[s]], natural(s)))


def natural(name: str) -> tuple:
    digits = "".join(c for c in name if c.isdigit())
    return (name.rstrip("0123456789"), int(digits) if digits else -1)


def listed(names, most: int = 8) -> str:
    """Names for a message a person reads: all of a few, the first ``most`` and a count of
    the rest of many (a failure of a thousand workers is one line, not a page)."""
    names = [str(n) for n in names]
    if len(names) <= most:
        return "[" + ", ".join(names) + "]"
    return "[" + ", ".join(names[:most]) + f", ... and {len(names) - most} more]"


def recovery_channel(replica: str, joiner: str) -> str:
    """The transfer group a recovery's joiner takes its state on from a live replica."""
    return f"rxfer.{replica}.{joiner}"


@dataclass(frozen=True)
class Pair:
    leaver: str
    joiner: str
    role: Role

    @property
    def transfer_group(self) -> str:
        return f"xfer.{self.leaver}.{self.joiner}"


@dataclass
class MigrationPlan:
    """Everything workers need for one migration (possibly several pairs at once)."""

    migration_id: int
    pairs: list[Pair]
    generations: dict[str, int]            # affected group -> generation being built
    stayers: dict[str, list[str]]          # affected stayer -> its affected groups
    groups_total: int
    rebuild_all: bool = False              # the naive baseline rebuilds every group

    @property
    def leavers(self) -> list[str]:
        return [p.leaver for p in self.pairs]

    @property
    def joiners(self) -> list[str]:
        return [p.joiner for p in self.pairs]

    @property
    def participants(self) -> list[str]:
        return self.leavers + self.joiners + sorted(self.stayers)

    def describe(self) -> dict:
        return {"migration_id": self.migration_id,
                "pairs": [{"leaver": p.leaver, "joiner": p.joiner, "role": p.role.name}
                          for p in self.pairs],
                "groups_rebuilt": len(self.generations), "groups_total": self.groups_total,
                "affected_groups": sorted(self.generations),
                "stayers": sorted(self.stayers)}


def plan_migration(m: Membership, migration_id: int, leavers: list[str],
                   targets: list[str] | None = None, busy: set[str] = frozenset(),
                   rebuild_all: bool = False) -> MigrationPlan:
    """Validate a request and decide who does what. Raises ``MigrationRefused`` naming the
    offending worker; nothing is changed either way."""
    if not leavers:
        raise MigrationRefused("no worker to migrate was given")
    seen = set()
    for w in leavers:
        if w in seen:
            raise MigrationRefused(f"worker {w} is named twice in one migration")
        seen.add(w)
        if w in m.standbys:
            raise MigrationRefused(f"worker {w} is a standby, not an active worker; only "
                                   f"active workers can be migrated")
        if w in m.departed:
            raise MigrationRefused(f"worker {w} has already left the job")
        if w not in m.workers:
            raise MigrationRefused(f"unknown worker {w!r}; active workers: "
                                   f"{', '.join(sorted(m.workers, key=natural))}")
        if w in busy:
            raise MigrationRefused(f"worker {w} is already part of a migration in flight")
    free = [s for s in m.free_standbys() if s not in busy]
    if targets:
        if len(targets) != len(leavers):
            raise MigrationRefused(f"{len(leavers)} workers to migrate but {len(targets)} "
                                   f"targets given (--to pairs one-to-one with --worker)")
        for t in targets:
            if t not in m.standbys:
                raise MigrationRefused(f"target {t!r} is not a standby of this job")
            if t not in free:
                raise MigrationRefused(f"standby {t} is not free "
                                       f"(state {m.standbys[t].value})")
        if len(set(targets)) != len(targets):
            raise MigrationRefused("the same standby is named twice as a target")
        joiners = list(targets)
    else:
        if len(free) < len(leavers):
            raise MigrationRefused(f"no free standby for {len(leavers)} worker(s): "
                                   f"{len(free)} free of {len(m.standbys)}")
        joiners = free[:len(leavers)]
    pairs = [Pair(w, j, m.workers[w]) for w, j in zip(leavers, joiners)]
    layout = m.layout
    # the naive baseline's plan lists every group and worker: O(N) by design
    affected = layout.communicator_groups() if rebuild_all else \
        layout.affected_groups(*[p.role for p in pairs])
    generations = {name: m.next_generation[name] for name in affected}
    return MigrationPlan(migration_id, pairs, generations, _members(m, affected, seen),
                         layout.communicator_group_count(), rebuild_all)


def _members(m: Membership, groups: dict[str, GroupSpec], exclude: set[str]
             ) -> dict[str, list[str]]:
    """Each active worker (but ``exclude``) -> the names of ``groups`` it is a member of,
    sorted. Read from the groups' members, so it costs their total size, not N; the workers
    come in the order of their first group."""
    out: dict[str, list[str]] = {}
    for name in sorted(groups):
        for role in groups[name].members:
            w = m.holder(role)
            if w is not None and w not in exclude:
                out.setdefault(w, []).append(name)
    return out


def reserve(m: Membership, plan: MigrationPlan) -> Membership:
    """The membership while a plan is in flight: joiners reserved, generations burned (an
    aborted attempt never reuses a store prefix a stuck builder may still be waiting on)."""
    out = m.copy()
    for j in plan.joiners:
        out.standbys[j] = StandbyState.RESERVED
    for name, gen in plan.generations.items():
        out.next_generation[name] = gen + 1
    return out


def commit(m: Membership, plan: MigrationPlan) -> Membership:
    """The membership after the switch: joiners hold the roles, leavers are gone."""
    out = m.copy()
    for p in plan.pairs:
        del out.workers[p.leaver]
        out.workers[p.joiner] = p.role
        out._holders[p.role] = p.joiner
        out.standbys.pop(p.joiner, None)
        out.departed.append(p.leaver)
    out.generations.update(plan.generations)
    return out


def abort(m: Membership, plan: MigrationPlan, dead: set[str]) -> Membership:
    """The membership after an aborted migration: live joiners return to the pool, dead
    ones are marked; roles and live generations are unchanged."""
    out = m.copy()
    for j in plan.joiners:
        if j in out.standbys:
            out.standbys[j] = StandbyState.DEAD if j in dead else StandbyState.COLD
    return out


def settle_on_failure(m: Membership, plan: MigrationPlan, handed_over: set[str]
                      ) -> tuple[Membership, list[Pair], list[Pair]]:
    """A failure while a migration is in flight. A pair whose leaver already handed its
    state to the joiner (at the switch boundary) is past the point of no return: the joiner
    holds the role, the leaver is gone, so the pair is committed. Every other pair is
    abandoned (its leaver still holds role and state). Returns (membership, committed,
    abandoned); groups whose members ended up on different generations are found dirty by
    the recovery and rebuilt."""
    done = [p for p in plan.pairs if p.leaver in handed_over]
    rest = [p for p in plan.pairs if p.leaver not in handed_over]
    out = m
    if done:
        out = commit(out, MigrationPlan(plan.migration_id, done, plan.generations, plan.stayers,
                                        plan.groups_total, plan.rebuild_all))
    if rest:
        out = abort(out, MigrationPlan(plan.migration_id, rest, {}, {}, plan.groups_total),
                    set())
    return out, done, rest


class MigrationState(str, Enum):
    PREPARING = "preparing"   # phase 1: groups and joiner prepared while training continues
    SWITCHING = "switching"   # phase 2 ordered: participants switch at an agreed boundary
    DONE = "done"
    ABORTED = "aborted"


def next_state(state: MigrationState, *, ready: set[str], switched: set[str],
               participants: set[str], dead: set[str], joiners: set[str]
               ) -> tuple[MigrationState, str]:
    """One transition of the migration state machine, with the reason.

    PREPARING -> ABORTED   a joiner died before the switch was ordered (nothing has changed
                           for the job yet: it continues on the old generation)
    PREPARING -> SWITCHING every participant finished phase 1
    SWITCHING -> DONE      every participant reported its switch
    A death after the switch was ordered is a failure during migration (failure handling).
    """
    if state is MigrationState.PREPARING:
        if dead & joiners:
            return MigrationState.ABORTED, f"joiner {sorted(dead & joiners)[0]} died in phase 1"
        if participants <= ready:
            return MigrationState.SWITCHING, "all participants prepared"
    elif state is MigrationState.SWITCHING:
        if participants <= switched:
            return MigrationState.DONE, "all participants switched"
    return state, ""


# --- unexpected failures ---------------------------------------------------------------------

class RecoveryImpossible(RuntimeError):
    """No way to restore a failed role without losing committed progress."""


@dataclass
class RecoveryPlan:
    """How the job comes back from the failure of ``failed`` workers.

    ``sources`` maps each failed role to where its state comes from: ``replica:<worker>``
    (a live data-parallel replica, which holds exactly the same state after a committed
    step; ``stripes`` names the further replicas that send a share of it beside that
    one), ``snapshot`` (the in-memory peer snapshot) or ``checkpoint`` (on disk). If any
    role has no replica, every role rolls back to the newer of the newest complete snapshot
    and checkpoint (``rollback_step``; a snapshot on a tie: no disk is read), since the
    survivors are ahead of it."""

    recovery_id: int
    pairs: list[Pair]                       # failed worker -> joiner (a standby)
    sources: dict[str, str]                 # role -> "replica:<worker>"|"snapshot"|"checkpoint"
    rollback_step: int | None               # resume step of a rollback, or None
    generations: dict[str, int]             # groups rebuilt -> their new generation
    stayers: dict[str, list[str]]           # live worker -> its groups being rebuilt
    groups_total: int
    rollback_source: str | None = None      # "snapshot" | "checkpoint", with rollback_step
    # role -> the further live replicas sending a share of its state (striped recovery)
    stripes: dict[str, list[str]] = field(default_factory=dict)

    def senders(self, role: str) -> list[str]:
        """Every replica sending ``role``'s state, share 0 first ([] without a replica)."""
        src = self.sources[role]
        if not src.startswith("replica:"):
            return []
        return [src.split(":", 1)[1]] + self.stripes.get(role, [])

    @property
    def failed(self) -> list[str]:
        return [p.leaver for p in self.pairs]

    @property
    def joiners(self) -> list[str]:
        return [p.joiner for p in self.pairs]

    def describe(self) -> dict:
        return {"recovery_id": self.recovery_id,
                "pairs": [{"failed": p.leaver, "joiner": p.joiner, "role": p.role.name}
                          for p in self.pairs],
                "sources": self.sources, "stripes": self.stripes,
                "rollback_step": self.rollback_step,
                "rollback_source": self.rollback_source,
                "groups_rebuilt": len(self.generations), "groups_total": self.groups_total,
                "rebuilt_groups": sorted(self.generations)}


def replica_of(m: Membership, role: Role, exclude: set[str]) -> str | None:
    """A live worker holding the same (pp, tp) position in another data-parallel replica,
    the lowest dp rank first (none when the dp roles hold shards, not replicas:
    ``Layout.dp_sharded``). O(DP)."""
    if m.layout.dp_sharded:
        return None
    for dp in range(m.layout.dp):
        w = m.holder(Role(dp, role.pp, role.tp)) if dp != role.dp else None
        if w is not None and w not in exclude:
            return w
    return None


def without_replica(m: Membership, failed: set[str]) -> bool:
    """Whether some role of ``failed`` is left with no live data-parallel replica (the same
    answer as ``replica_of`` for each, by counting each (pp, tp) position's losses:
    O(len(failed)), where asking ``replica_of`` for thousands of failed roles is O(DP) each)."""
    roles = [m.workers[w] for w in failed if w in m.workers]
    if not roles:
        return False
    if m.layout.dp_sharded:
        return True
    lost: dict[tuple[int, int], int] = {}
    for r in roles:
        lost[(r.pp, r.tp)] = lost.get((r.pp, r.tp), 0) + 1
    return any(n >= m.layout.dp for n in lost.values())


def fence_silent_later(m: Membership, failed: set[str], silent: list[str], waited_s: float,
                       max_wait_s: float, copy_available) -> str | None:
    """Why not to fence ``silent`` (survivors ``silent_survivors`` names) yet, or None to
    fence them now: always past ``max_wait_s``; before it, only if the job can take their
    loss: no more of them than there are free standbys (at least one), since replacing more
    turns the recovery into a restart, and that many silent at once is the reports' path
    being slow, not as many workers hung; and the job still recoverable without them, from
    replicas or a copy (``copy_available()``: a complete snapshot or checkpoint; asked only
    when needed).
    8,192 simulated workers whose reports came in bursts on a saturated machine were all
    but 416 fenced after a 6 s lull, which left roles with no copy: the job failed."""
    if waited_s > max_wait_s:
        return None
    free = len(m.free_standbys())
    if len(silent) > max(1, free):
        return f"more of them than free standbys ({free})"
    if without_replica(m, set(failed) | set(silent)) and not copy_available():
        return "roles would be left with no copy of their state"
    return None


def plan_recovery(m: Membership, recovery_id: int, failed: list[str], dirty: set[str],
                  checkpoint_step: int | None, busy: set[str] = frozenset(),
                  snapshot_step: int | None = None, max_sources: int = 1) -> RecoveryPlan:
    """Decide joiners, state sources and the groups to rebuild after ``failed`` workers died.
    ``snapshot_step`` and ``checkpoint_step``: the newest complete peer snapshot and disk
    checkpoint, if any. ``max_sources``: a role restored from replicas takes its state from
    up to this many of them at once, a share from each (``stripes``; O(DP) a role).

    Rebuilt: every group of a failed role, plus every *dirty* group (one on which some
    survivor had an operation in flight when the step was aborted: its sequence of
    operations no longer matches between members). Clean groups are kept."""
    if not failed:
        raise ValueError("no failed worker given")
    unknown = [w for w in failed if w not in m.workers]
    if unknown:
        raise ValueError(f"failed worker(s) {unknown} hold no role")
    free = [s for s in m.free_standbys() if s not in busy]
    if len(free) < len(failed):
        raise RecoveryImpossible(f"{len(failed)} failed worker(s) but {len(free)} free standby")
    pairs = [Pair(w, j, m.workers[w]) for w, j in zip(failed, free)]
    dead = set(failed)
    sources = {}
    for p in pairs:
        replica = replica_of(m, p.role, dead)
        sources[p.role.name] = f"replica:{replica}" if replica else "checkpoint"
    rollback = rollback_source = None
    if any(src == "checkpoint" for src in sources.values()):
        if checkpoint_step is None and snapshot_step is None:
            raise RecoveryImpossible(
                f"role(s) {listed(r for r, s in sources.items() if s == 'checkpoint')} have no "
                f"live data-parallel replica and there is no complete snapshot or checkpoint")
        if snapshot_step is not None and (checkpoint_step is None or
                                          snapshot_step >= checkpoint_step):
            rollback, rollback_source = snapshot_step, "snapshot"
        else:
            rollback, rollback_source = checkpoint_step, "checkpoint"
        sources = {r: rollback_source for r in sources}  # everyone goes back together
    layout = m.layout
    stripes = {}
    if rollback is None and max_sources > 1:
        for p in pairs:
            first = sources[p.role.name].split(":", 1)[1]
            more = [w for dp in range(layout.dp) if dp != p.role.dp
                    and (w := m.holder(Role(dp, p.role.pp, p.role.tp))) is not None
                    and w not in dead and w != first]
            if more:
                stripes[p.role.name] = more[:max_sources - 1]
    rebuild = dict(layout.affected_groups(*[p.role for p in pairs]))
    for name in sorted(dirty):
        spec = layout.group(name)
        if spec is not None and not spec.trivial:
            rebuild[name] = spec
    generations = {name: m.next_generation[name] for name in rebuild}
    return RecoveryPlan(recovery_id, pairs, sources, rollback, generations,
                        _members(m, rebuild, dead), layout.communicator_group_count(),
                        rollback_source, stripes)



def dirty_groups(layout: Layout, reports: dict[str, dict[str, dict]],
                 holders: dict[str, Role]) -> set[str]:
    """Groups whose members no longer agree on their sequence of operations after an
    aborted step, from each survivor's accounting (``group -> {coll, sent, recv, pending}``).

    A group is clean only if no member has an operation pending, every member issued the
    same number of collectives, and in a pipeline pair each side received exactly what the
    other sent (a message sent but never received would be read by the next step's receive).
    Groups with a member that did not report (dead) are not judged here: they are rebuilt
    as the failed role's groups. One pass over the survivors' reports, each looked at for
    its own groups only (a name it reports that is not one of its groups counts for
    nothing: its members' reports judge that group): O(survivors); parsing every reported
    group's name and building its members was 0.33 s of a recovery's plan at 4K workers."""
    role_holder = {r: w for w, r in holders.items()}
    found: dict[str, tuple[str, int, list[dict]]] = {}   # name -> kind, size, accounts
    for w, accounts in reports.items():
        role = holders.get(w)
        if role is None or role_holder.get(role) != w:
            continue                      # not the holder of a role: judges nothing
        for name, kind, size in layout.group_names_of(role):
            acc = accounts.get(name)
            if acc is None:
                continue
            entry = found.get(name)
            if entry is None:
                entry = found[name] = (kind, size, [])
            entry[2].append(acc)
    dirty = set()
    for name, (kind, size, acc) in found.items():
        if len(acc) < size:
            continue                      # a member did not report (dead): rebuilt anyway
        if any(a["pending"] for a in acc) or len({a["generation"] for a in acc}) > 1:
            dirty.add(name)
        elif len({a["coll"] for a in acc}) > 1:
            dirty.add(name)
        elif kind == "p2p" and (acc[0]["sent"] != acc[1]["recv"] or
                                acc[1]["sent"] != acc[0]["recv"]):
            dirty.add(name)
    return dirty


def silent_survivors(missing: list[str], waited_s: float, quiet_s: float, timeout_s: float,
                     max_wait_s: float, said_silent: frozenset[str] | set[str] = frozenset(),
                     hosted: frozenset[str] | set[str] = frozenset()) -> list[str]:
    """The survivors to fence as hung for sending no report after an abort, of those
    ``missing``:

    - one whose host's agent named it silent (``said_silent``: no report ``timeout_s``
      after the abort reached its host, timed there);
    - one whose host has an agent (``hosted``) but has said nothing of it, once twice
      ``timeout_s`` passed without any new report (``quiet_s``: since the abort or the last
      report read): the agent's word is due ``timeout_s`` after the abort, its write may
      lag as much again (a host whose writes lagged every other's by 6 s on a saturated
      machine had its healthy worker fenced; a host that is gone is the host-silence
      rules' to judge);
    - one with no agent, once ``timeout_s`` passed without any new report;
    - all of them ``max_wait_s`` after the abort however reports keep coming.

    While reports keep arriving the control plane is slow, not these workers: a fixed
    deadline once fenced thousands of healthy survivors of a large job whose reports
    queued at the store, and the job failed for want of standbys (``fence_silent_later``
    then says whether the job can take their loss)."""
    if not missing:
        return []
    if waited_s > max_wait_s:
        return sorted(missing, key=natural)
    return sorted((w for w in missing if w in said_silent or
                   quiet_s > (2 * timeout_s if w in hosted else timeout_s)), key=natural)
