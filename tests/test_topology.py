import itertools

import pytest

from trainmover.core.topology import GROUP_KINDS, Layout, Role, StageKind, split_layers

LAYOUTS = [Layout(d, p, t) for d, p, t in itertools.product((1, 2, 3), (1, 2, 3, 4), (1, 2))]


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_rank_role_bijection(layout):
    roles = layout.roles()
    assert len(set(roles)) == layout.num_roles
    for rank, role in enumerate(roles):
        assert layout.global_rank(role) == rank
        assert Role.parse(role.name) == role


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_every_role_in_exactly_one_group_per_kind(layout):
    groups = layout.all_groups()
    for role in layout.roles():
        for kind in ("tp", "dp", "pp"):
            holding = [g for g in groups.values() if g.kind == kind and role in g.members]
            assert len(holding) == 1, (role, kind)
        p2p = [g for g in groups.values() if g.kind == "p2p" and role in g.members]
        inner = role.pp not in (0, layout.pp - 1)
        assert len(p2p) == (0 if layout.pp == 1 else 2 if inner else 1)
    assert {g.kind for g in groups.values()} <= set(GROUP_KINDS)


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_group_members_share_the_other_coordinates(layout):
    for g in layout.all_groups().values():
        if g.kind == "tp":
            assert [m.tp for m in g.members] == list(range(layout.tp))
            assert len({(m.dp, m.pp) for m in g.members}) == 1
        elif g.kind == "dp":
            assert [m.dp for m in g.members] == list(range(layout.dp))
            assert len({(m.pp, m.tp) for m in g.members}) == 1
        elif g.kind == "pp":
            assert [m.pp for m in g.members] == list(range(layout.pp))
        else:
            a, b = g.members
            assert (a.dp, a.tp) == (b.dp, b.tp) and b.pp == a.pp + 1


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_group_counts(layout):
    d, p, t = layout.dp, layout.pp, layout.tp
    groups = layout.all_groups()
    assert sum(g.kind == "tp" for g in groups.values()) == d * p
    assert sum(g.kind == "dp" for g in groups.values()) == p * t
    assert sum(g.kind == "pp" for g in groups.values()) == d * t
    assert sum(g.kind == "p2p" for g in groups.values()) == d * t * (p - 1)


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_affected_groups_are_exactly_the_nontrivial_groups_of_the_leaver(layout):
    comm = layout.communicator_groups()
    for role in layout.roles():
        affected = layout.affected_groups(role)
        assert all(role in g.members for g in affected.values())
        assert set(affected) == {n for n, g in comm.items() if role in g.members}
        edge = role.pp in (0, layout.pp - 1)
        # tp + dp + the pipeline column + one or two neighbour pairs
        expected = (layout.tp > 1) + (layout.dp > 1) + (layout.pp > 1) * (1 + (1 if edge else 2))
        assert len(affected) == expected
    # two leavers: the union, each group once
    roles = layout.roles()
    if len(roles) >= 2:
        both = layout.affected_groups(roles[0], roles[-1])
        assert set(both) == set(layout.affected_groups(roles[0])) | set(
            layout.affected_groups(roles[-1]))


def test_dp2_pp2_tp2_counts_match_the_platform_probe():
    layout = Layout(2, 2, 2)
    assert len(layout.communicator_groups()) == 16
    assert len(layout.affected_groups(Role(1, 0, 1))) == 4


def test_stage_kinds():
    assert Layout(1, 1, 1).stage_kind(0) is StageKind.ONLY
    kinds = [Layout(1, 4, 1).stage_kind(s) for s in range(4)]
    assert kinds == [StageKind.FIRST, StageKind.MIDDLE, StageKind.MIDDLE, StageKind.LAST]
    assert Layout(1, 2, 1).stage_kind(Role(0, 1, 0)) is StageKind.LAST
    with pytest.raises(ValueError, match="stage 2"):
        Layout(1, 2, 1).stage_kind(2)


def test_split_layers():
    assert split_layers(4, 2) == [range(0, 2), range(2, 4)]
    assert split_layers(5, 3) == [range(0, 2), range(2, 4), range(4, 5)]
    for n in range(1, 12):
        for s in range(1, n + 1):
            parts = split_layers(n, s)
            assert [i for r in parts for i in r] == list(range(n))
            assert max(map(len, parts)) - min(map(len, parts)) <= 1
    with pytest.raises(ValueError, match="n_layers=2.*pp=3"):
        split_layers(2, 3)


def test_bad_layout_and_role_names():
    with pytest.raises(ValueError, match="dp must be a positive integer, got 0"):
        Layout(0, 1, 1)
    with pytest.raises(ValueError, match="not a role name: 'w3'"):
        Role.parse("w3")
    with pytest.raises(ValueError, match="outside layout"):
        Layout(1, 1, 1).check_role(Role(0, 1, 0))
