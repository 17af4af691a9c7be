"""Parallel layout maths: roles, their coordinates, and the communication groups they belong to.

Pure Python on purpose (no torch.distributed): the controller plans migrations with these
functions, and every group that a migration rebuilds is named here first.

Vocabulary
- A *role* is one position in the DP x PP x TP layout, written ``dp{d}.pp{p}.tp{t}``. Roles are
  fixed for the life of a job; the *worker* process holding a role may change (migration).
- A *group* is one communicator: a named, ordered list of roles. Four kinds:
  ``tp``   tensor-parallel peers of one (dp, pp) cell, ordered by tp rank;
  ``dp``   data-parallel replicas of one (pp, tp) cell, ordered by dp rank;
  ``pp``   the pipeline column of one (dp, tp) pair, ordered by stage (gradient norm, loss);
  ``p2p``  one pipeline neighbour pair (stage p and p + 1), carrying activations and gradients.
  Groups with a single member are *trivial*: they exist in the plan but need no communicator.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
import re

GROUP_KINDS = ("tp", "dp", "pp", "p2p")
# a group name, parsed leniently (``Layout.group`` checks it against the name it builds);
# digits bounded, as int() refuses very long ones and no layout is that large
_GROUP_NAME = re.compile(r"(tp|dp|pp|p2p)\.(dp|pp|tp)([0-9]{1,9})\.(dp|pp|tp)([0-9]{1,9})"
                         r"(?:\.pp([0-9]{1,9})-[0-9]{1,9})?")


class StageKind(str, Enum):
    """What a pipeline stage owns besides its transformer blocks."""

    ONLY = "only"      # pp == 1: embedding, blocks and head
    FIRST = "first"    # embedding + blocks
    MIDDLE = "middle"  # blocks only
    LAST = "last"      # blocks + final norm + head


@dataclass(frozen=True, order=True)
class Role:
    dp: int
    pp: int
    tp: int

    @property
    def name(self) -> str:
        return f"dp{self.dp}.pp{self.pp}.tp{self.tp}"

    def __str__(self) -> str:
        return self.name

    @staticmethod
    def parse(text: str) -> "Role":
        m = re.fullmatch(r"dp(\d+)\.pp(\d+)\.tp(\d+)", text)
        if not m:
            raise ValueError(f"not a role name: {text!r} (expected dp<d>.pp<p>.tp<t>)")
        return Role(int(m.group(1)), int(m.group(2)), int(m.group(3)))


@dataclass(frozen=True)
class GroupSpec:
    """One communicator of the plan: its stable name and its members in group-rank order."""

    name: str
    kind: str
    members: tuple[Role, ...]

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def trivial(self) -> bool:
        return len(self.members) == 1

    def rank_of(self, role: Role) -> int:
        return self.members.index(role)


@dataclass(frozen=True)
class Layout:
    """A DP x PP x TP layout. Global rank order is dp-major, then pp, then tp (tp fastest),
    so tensor-parallel peers are adjacent, as a launcher would place them on one host.

    ``dp_sharded``: the data-parallel roles hold *shards* of the state (FSDP2, ZeRO over the
    dp axis), not replicas. Nothing is then recovered from another dp role, replicas are
    not compared, and every role's share makes up the final state."""

    dp: int = 1     # data-parallel degree: replicas (or, with dp_sharded, shards) of the model
    pp: int = 1     # pipeline-parallel degree: the number of pipeline stages
    tp: int = 1     # tensor-parallel degree: ranks that split each layer's weights
    dp_sharded: bool = False

    def __post_init__(self) -> None:
        for axis in ("dp", "pp", "tp"):
            value = getattr(self, axis)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"layout axis {axis} must be a positive integer, got {value!r}")
        if not isinstance(self.dp_sharded, bool):
            raise ValueError(f"layout dp_sharded must be true or false, got "
                             f"{self.dp_sharded!r}")

    @property
    def has_replicas(self) -> bool:
        """Whether roles that differ only in their dp rank hold the same state."""
        return self.dp > 1 and not self.dp_sharded

    def holds_final_share(self, role: "Role") -> bool:
        """Whether ``role``'s state is part of the canonical (final) state: data-parallel
        rank 0 of each (pp, tp) when dp roles are replicas, every role when they are shards."""
        return self.dp_sharded or role.dp == 0

    @property
    def num_roles(self) -> int:
        return self.dp * self.pp * self.tp

    def __str__(self) -> str:
        return f"DP{self.dp}xPP{self.pp}xTP{self.tp}" + (" (dp sharded)" if self.dp_sharded
                                                         else "")

    def as_dict(self) -> dict:
        out = {"dp": self.dp, "pp": self.pp, "tp": self.tp}
        if self.dp_sharded:
            out["dp_sharded"] = True
        return out

    # --- roles --------------------------------------------------------------------------
    def roles(self) -> list[Role]:
        return [self.role_of(r) for r in range(self.num_roles)]

    def role_of(self, global_rank: int) -> Role:
        if not 0 <= global_rank < self.num_roles:
            raise ValueError(f"global rank {global_rank} outside layout {self}")
        tp = global_rank % self.tp
        pp = (global_rank // self.tp) % self.pp
        dp = global_rank // (self.tp * self.pp)
        return Role(dp, pp, tp)

    def global_rank(self, role: Role) -> int:
        self.check_role(role)
        return (role.dp * self.pp + role.pp) * self.tp + role.tp

    def check_role(self, role: Role) -> None:
        if not (0 <= role.dp < self.dp and 0 <= role.pp < self.pp and 0 <= role.tp < self.tp):
            raise ValueError(f"role {role} is outside layout {self}")

    def stage_kind(self, role_or_stage: Role | int) -> StageKind:
        stage = role_or_stage.pp if isinstance(role_or_stage, Role) else role_or_stage
        if not 0 <= stage < self.pp:
            raise ValueError(f"stage {stage} outside layout {self}")
        if self.pp == 1:
            return StageKind.ONLY
        if stage == 0:
            return StageKind.FIRST
        if stage == self.pp - 1:
            return StageKind.LAST
        return StageKind.MIDDLE

    # --- groups -------------------------------------------------------------------------
    def tp_group(self, role: Role) -> GroupSpec:
        return GroupSpec(_tp_name(role.dp, role.pp), "tp",
                         tuple(Role(role.dp, role.pp, t) for t in range(self.tp)))

    def dp_group(self, role: Role) -> GroupSpec:
        return GroupSpec(_dp_name(role.pp, role.tp), "dp",
                         tuple(Role(d, role.pp, role.tp) for d in range(self.dp)))

    def pp_group(self, role: Role) -> GroupSpec:
        return GroupSpec(_pp_name(role.dp, role.tp), "pp",
                         tuple(Role(role.dp, p, role.tp) for p in range(self.pp)))

    def p2p_group(self, dp: int, tp: int, stage: int) -> GroupSpec:
        """The pair (stage, stage + 1) of pipeline column (dp, tp)."""
        if not 0 <= stage < self.pp - 1:
            raise ValueError(f"no pipeline pair starts at stage {stage} in layout {self}")
        return GroupSpec(_p2p_name(dp, tp, stage), "p2p",
                         (Role(dp, stage, tp), Role(dp, stage + 1, tp)))

    def groups_of(self, role: Role) -> dict[str, GroupSpec]:
        """The groups a role belongs to, keyed by its local slot name:
        ``tp``, ``dp``, ``pp``, ``p2p_prev`` (to stage - 1), ``p2p_next`` (to stage + 1)."""
        self.check_role(role)
        out = {"tp": self.tp_group(role), "dp": self.dp_group(role), "pp": self.pp_group(role)}
        if role.pp > 0:
            out["p2p_prev"] = self.p2p_group(role.dp, role.tp, role.pp - 1)
        if role.pp < self.pp - 1:
            out["p2p_next"] = self.p2p_group(role.dp, role.tp, role.pp)
        return out

    def group_names_of(self, role: Role) -> list[tuple[str, str, int]]:
        """``(name, kind, size)`` of each non-trivial group ``role`` belongs to, as
        ``groups_of`` has them, without building their members (a recovery's verdict on
        every group looks at each survivor's: ``decisions.dirty_groups``)."""
        out = []
        if self.tp > 1:
            out.append((_tp_name(role.dp, role.pp), "tp", self.tp))
        if self.dp > 1:
            out.append((_dp_name(role.pp, role.tp), "dp", self.dp))
        if self.pp > 1:
            out.append((_pp_name(role.dp, role.tp), "pp", self.pp))
        if role.pp > 0:
            out.append((_p2p_name(role.dp, role.tp, role.pp - 1), "p2p", 2))
        if role.pp < self.pp - 1:
            out.append((_p2p_name(role.dp, role.tp, role.pp), "p2p", 2))
        return out

    def all_groups(self) -> dict[str, GroupSpec]:
        """Every group of the layout, trivial ones included, keyed by group name. O(N): each
        group is built once (``group`` builds one by name)."""
        return {spec.name: spec for spec in self._groups_in_order(trivial=True)}

    def communicator_groups(self) -> dict[str, GroupSpec]:
        """The groups that need a real communicator (two or more members). O(N)."""
        return {spec.name: spec for spec in self._groups_in_order(trivial=False)}

    def communicator_group_count(self) -> int:
        """``len(communicator_groups())``, by arithmetic."""
        d, p, t = self.dp, self.pp, self.tp
        return (d * p if t > 1 else 0) + (p * t if d > 1 else 0) + \
            (d * t if p > 1 else 0) + d * t * (p - 1)

    def _groups_in_order(self, trivial: bool) -> Iterator[GroupSpec]:
        """Each group once, ordered by its first role in global rank order, then tp, dp, pp,
        p2p: the order the groups always came in (a new membership and the naive plan keep it)."""
        dp, pp, tp = self.dp, self.pp, self.tp
        tp_on, dp_on, pp_on = trivial or tp > 1, trivial or dp > 1, trivial or pp > 1
        # one Role per rank, shared by its groups (members are slices of the rank order):
        # building each group's roles afresh cost several times more at scale
        roles = [Role(d, p, t) for d in range(dp) for p in range(pp) for t in range(tp)]
        for rank, role in enumerate(roles):
            d, p, t = role.dp, role.pp, role.tp
            if t == 0 and tp_on:
                yield GroupSpec(_tp_name(d, p), "tp", tuple(roles[rank:rank + tp]))
            if d == 0 and dp_on:
                yield GroupSpec(_dp_name(p, t), "dp", tuple(roles[rank::pp * tp]))
            if p == 0 and pp_on:
                yield GroupSpec(_pp_name(d, t), "pp", tuple(roles[rank:rank + pp * tp:tp]))
            if p < pp - 1:
                yield GroupSpec(_p2p_name(d, t, p), "p2p", (role, roles[rank + tp]))

    def group(self, name: str) -> GroupSpec | None:
        """The group called ``name`` (trivial or not), or None if the layout has none such:
        O(group size), where looking it up in ``all_groups()`` builds every group first."""
        m = _GROUP_NAME.fullmatch(name) if isinstance(name, str) else None
        if m is None:
            return None
        kind, coords = m[1], {"dp": 0, "pp": 0, "tp": 0, m[2]: int(m[3]), m[4]: int(m[5])}
        if m[6] is not None:
            coords["pp"] = int(m[6])
        role = Role(**coords)
        if not (0 <= role.dp < self.dp and 0 <= role.pp < self.pp and 0 <= role.tp < self.tp):
            return None
        if kind == "p2p":
            if role.pp >= self.pp - 1:
                return None
            spec = self.p2p_group(role.dp, role.tp, role.pp)
        else:
            spec = getattr(self, f"{kind}_group")(role)
        # parsing was lenient (order of coordinates, a pair's end): only the name the layout
        # itself writes for this group names it
        return spec if spec.name == name else None

    def affected_groups(self, *roles: Role) -> dict[str, GroupSpec]:
        """Groups that must be rebuilt when the workers holding ``roles`` are replaced:
        every non-trivial group containing any of them. Everything else is inherited."""
        out: dict[str, GroupSpec] = {}
        for role in roles:
            for spec in self.groups_of(role).values():
                if not spec.trivial:
                    out[spec.name] = spec
        return dict(sorted(out.items()))


def _tp_name(dp: int, pp: int) -> str:
    return f"tp.dp{dp}.pp{pp}"


def _dp_name(pp: int, tp: int) -> str:
    return f"dp.pp{pp}.tp{tp}"


def _pp_name(dp: int, tp: int) -> str:
    return f"pp.dp{dp}.tp{tp}"


def _p2p_name(dp: int, tp: int, stage: int) -> str:
    return f"p2p.dp{dp}.tp{tp}.pp{stage}-{stage + 1}"


def split_layers(num_layers: int, num_stages: int) -> list[range]:
    """Contiguous block ranges per pipeline stage; earlier stages take the remainder, since
    the last stage also carries the head."""
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_layers < num_stages:
        raise ValueError(f"n_layers={num_layers} is fewer than pipeline stages pp={num_stages}")
    base, extra = divmod(num_layers, num_stages)
    out, start = [], 0
    for s in range(num_stages):
        n = base + (1 if s < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


def reporter_role(layout: Layout) -> Role:
    """The role that writes metrics.jsonl: it holds the loss (last stage) and is unique."""
    return Role(0, layout.pp - 1, 0)
