"""Controller decisions, without processes."""
import pytest

from trainmover.core import decisions as C
from trainmover.core.faults import Inject, parse_inject, validate_injects
from trainmover.core.topology import Layout, Role


def membership(layout=Layout(2, 3, 2), standbys=2):
    m = C.Membership.initial(layout, [f"w{i}" for i in range(layout.num_roles)],
                             [f"s{i}" for i in range(standbys)])
    for s in m.standbys:
        m.standbys[s] = C.StandbyState.COLD
    return m


@pytest.mark.parametrize("worker", [f"w{i}" for i in range(12)])
def test_plan_rebuilds_exactly_the_affected_groups(worker):
    m = membership()
    plan = C.plan_migration(m, 1, [worker])
    role = m.workers[worker]
    assert set(plan.generations) == set(m.layout.affected_groups(role))
    assert all(g == 1 for g in plan.generations.values())
    assert plan.pairs == [C.Pair(worker, "s0", role)]
    # stayers: exactly the other members of those groups, each with its own groups
    expected = {}
    for name, spec in m.layout.affected_groups(role).items():
        for r in spec.members:
            if r != role:
                expected.setdefault(next(w for w, x in m.workers.items() if x == r), []).append(name)
    assert plan.stayers == {w: sorted(g) for w, g in expected.items()}
    assert plan.groups_total == len(m.layout.communicator_groups())


def test_two_leavers_at_once_share_one_plan():
    m = membership()
    plan = C.plan_migration(m, 1, ["w0", "w1"])  # TP peers: their tp group is rebuilt once
    assert [p.joiner for p in plan.pairs] == ["s0", "s1"]
    assert set(plan.generations) == set(m.layout.affected_groups(Role(0, 0, 0), Role(0, 0, 1)))
    assert "w0" not in plan.stayers and "w1" not in plan.stayers


@pytest.mark.parametrize("leavers, targets, busy, message", [
    (["w99"], None, set(), "unknown worker 'w99'"),
    (["s0"], None, set(), "worker s0 is a standby"),
    (["w1", "w1"], None, set(), "worker w1 is named twice"),
    (["w1"], None, {"w1"}, "worker w1 is already part of a migration in flight"),
    (["w1", "w2", "w3"], None, set(), "no free standby for 3 worker(s): 2 free of 2"),
    (["w1"], ["s7"], set(), "target 's7' is not a standby"),
    (["w1"], ["s0", "s1"], set(), "1 workers to migrate but 2 targets"),
    ([], None, set(), "no worker to migrate"),
])
def test_refusals_name_the_problem(leavers, targets, busy, message):
    m = membership()
    with pytest.raises(C.MigrationRefused) as err:
        C.plan_migration(m, 1, leavers, targets, busy)
    assert message in str(err.value)


def test_reserve_commit_and_a_second_migration():
    m = membership()
    plan = C.plan_migration(m, 1, ["w3"], ["s1"])
    m = C.reserve(m, plan)
    assert m.standbys["s1"] is C.StandbyState.RESERVED
    with pytest.raises(C.MigrationRefused, match="standby s1 is not free"):
        C.plan_migration(m, 2, ["w4"], ["s1"])
    m = C.commit(m, plan)
    assert m.workers["s1"] == Role(0, 1, 1) and "w3" not in m.workers
    assert m.departed == ["w3"]
    assert all(m.generations[g] == 1 for g in plan.generations)
    with pytest.raises(C.MigrationRefused, match="worker w3 has already left"):
        C.plan_migration(m, 2, ["w3"])
    # the joiner is now an active worker and can itself be migrated; its groups go to gen 2
    plan2 = C.plan_migration(m, 2, ["s1"])
    assert plan2.pairs[0].role == Role(0, 1, 1) and plan2.pairs[0].joiner == "s0"
    assert all(g == 2 for g in plan2.generations.values())
    with pytest.raises(C.MigrationRefused, match="no free standby"):
        C.plan_migration(C.commit(C.reserve(m, plan2), plan2), 3, ["w0"])


def test_abort_keeps_roles_and_never_reuses_a_generation():
    m = membership()
    plan = C.plan_migration(m, 1, ["w2"])
    reserved = C.reserve(m, plan)
    after = C.abort(reserved, plan, dead={"s0"})
    assert after.workers == m.workers and after.generations == m.generations
    assert after.standbys["s0"] is C.StandbyState.DEAD
    retry = C.plan_migration(after, 2, ["w2"])
    assert retry.pairs[0].joiner == "s1"
    assert all(retry.generations[g] == plan.generations[g] + 1 for g in retry.generations)


def test_a_failure_mid_migration_keeps_the_pairs_whose_state_moved():
    m = membership()
    plan = C.plan_migration(m, 1, ["w0", "w5"])
    m = C.reserve(m, plan)
    out, done, rest = C.settle_on_failure(m, plan, handed_over={"w5"})
    assert [p.leaver for p in done] == ["w5"] and [p.leaver for p in rest] == ["w0"]
    assert out.workers["s1"] == m.workers["w5"] and "w5" not in out.workers
    assert out.departed == ["w5"]
    # w0 keeps its role; its joiner goes back to the pool
    assert out.workers["w0"] == m.workers["w0"] and out.standbys["s0"] is C.StandbyState.COLD
    assert "s1" not in out.standbys
    # nothing handed over: plain abort; everything handed over: plain commit
    none, done, rest = C.settle_on_failure(m, plan, set())
    assert not done and none.workers == m.workers
    both, done, rest = C.settle_on_failure(m, plan, {"w0", "w5"})
    assert not rest and both.workers == C.commit(m, plan).workers


def test_warm_standbys_are_preferred():
    m = membership(standbys=3)
    m.standbys["s2"] = C.StandbyState.WARM
    assert C.plan_migration(m, 1, ["w0"]).pairs[0].joiner == "s2"


def test_state_machine():
    S = C.MigrationState
    parts, joiners = {"w1", "s0", "w0"}, {"s0"}
    kw = dict(participants=parts, joiners=joiners)
    assert C.next_state(S.PREPARING, ready={"w1"}, switched=set(), dead=set(), **kw)[0] is S.PREPARING
    assert C.next_state(S.PREPARING, ready=parts, switched=set(), dead=set(), **kw)[0] is S.SWITCHING
    state, why = C.next_state(S.PREPARING, ready=set(), switched=set(), dead={"s0"}, **kw)
    assert state is S.ABORTED and "s0 died in phase 1" in why
    assert C.next_state(S.SWITCHING, ready=parts, switched={"w1"}, dead=set(), **kw)[0] is S.SWITCHING
    assert C.next_state(S.SWITCHING, ready=parts, switched=parts, dead=set(), **kw)[0] is S.DONE


def test_inject_syntax():
    assert parse_inject("migrate@12:w3") == Inject("migrate", 12, "w3")
    assert parse_inject("migrate@4:w1:s0") == Inject("migrate", 4, "w1", "s0")
    for bad, msg in [("migrate@x:w3", "expected KIND@STEP"), ("explode@3:w1", "unknown kind"),
                     ("migrate12w3", "expected KIND@STEP")]:
        with pytest.raises(ValueError, match=msg):
            parse_inject(bad)
    workers, standbys = ["w0", "w1"], ["s0"]
    validate_injects([parse_inject("migrate@3:w1")], 10, workers, standbys)
    for bad, msg in [("migrate@10:w1", "outside 1..9"), ("migrate@3:w7", "unknown worker 'w7'"),
                     ("migrate@3:w1:s4", "'s4' is not a standby")]:
        with pytest.raises(ValueError, match=msg):
            validate_injects([parse_inject(bad)], 10, workers, standbys)
    with pytest.raises(ValueError, match="no standby"):
        validate_injects([parse_inject("migrate@3:w1")], 10, workers, [])
    with pytest.raises(ValueError, match="migrated twice"):
        validate_injects([parse_inject("migrate@3:w1"), parse_inject("migrate@5:w1")], 10,
                         workers, standbys)


def test_recovery_from_a_replica_rebuilds_the_failed_roles_and_dirty_groups():
    m = membership()  # DP2xPP3xTP2, 2 standbys
    plan = C.plan_recovery(m, 1, ["w5"], dirty={"dp.pp0.tp0"}, checkpoint_step=None)
    role = m.workers["w5"]  # dp0.pp2.tp1
    assert plan.pairs == [C.Pair("w5", "s0", role)]
    assert plan.sources == {role.name: "replica:w11"}  # dp1.pp2.tp1
    assert plan.rollback_step is None
    assert set(plan.generations) == set(m.layout.affected_groups(role)) | {"dp.pp0.tp0"}
    assert "w5" not in plan.stayers
    assert plan.stayers["w0"] == ["dp.pp0.tp0"]  # dirty group member, not a neighbour
    assert "w2" not in plan.stayers  # dp0.pp1.tp0: no rebuilt group


def test_a_striped_recovery_takes_shares_from_up_to_max_sources_live_replicas():
    m = membership(Layout(4, 1, 1), standbys=2)           # w0..w3: four replicas
    one = C.plan_recovery(m, 1, ["w1"], set(), checkpoint_step=None)
    assert one.senders("dp1.pp0.tp0") == ["w0"] and one.stripes == {}
    plan = C.plan_recovery(m, 1, ["w1"], set(), checkpoint_step=None, max_sources=2)
    assert plan.sources == {"dp1.pp0.tp0": "replica:w0"}
    assert plan.senders("dp1.pp0.tp0") == ["w0", "w2"]
    # two failures: neither a dead worker nor the other failed role serves as a source
    both = C.plan_recovery(m, 1, ["w1", "w2"], set(), checkpoint_step=None, max_sources=4)
    assert both.senders("dp1.pp0.tp0") == ["w0", "w3"]
    assert both.senders("dp2.pp0.tp0") == ["w0", "w3"]
    # a rollback (a role without a replica) takes no stripes
    m2 = membership(Layout(1, 2, 1), standbys=1)
    assert C.plan_recovery(m2, 1, ["w0"], set(), 8, max_sources=4).stripes == {}


def test_recovery_without_a_replica_rolls_everyone_back_to_the_checkpoint():
    m = membership(Layout(1, 3, 2))
    plan = C.plan_recovery(m, 1, ["w2"], set(), checkpoint_step=40)
    assert plan.sources == {"dp0.pp1.tp0": "checkpoint"} and plan.rollback_step == 40
    with pytest.raises(C.RecoveryImpossible, match="no live data-parallel replica"):
        C.plan_recovery(m, 1, ["w2"], set(), checkpoint_step=None)
    # both replicas of a position dead at once: no replica left for either
    m2 = membership(Layout(2, 1, 1))
    plan2 = C.plan_recovery(m2, 1, ["w0", "w1"], set(), checkpoint_step=8)
    assert plan2.rollback_step == 8 and [p.joiner for p in plan2.pairs] == ["s0", "s1"]


def test_a_dp_sharded_role_is_never_recovered_from_another_dp_role():
    """FSDP2 over dp: the other dp role holds another shard, not a copy: every role rolls
    back to the newest checkpoint (or snapshot) together."""
    m = membership(Layout(2, 1, 1, dp_sharded=True))
    plan = C.plan_recovery(m, 1, ["w1"], set(), checkpoint_step=10)
    assert plan.sources == {"dp1.pp0.tp0": "checkpoint"} and plan.rollback_step == 10
    with pytest.raises(C.RecoveryImpossible, match="no live data-parallel replica"):
        C.plan_recovery(m, 1, ["w1"], set(), checkpoint_step=None)


def test_recovery_needs_a_free_standby():
    m = membership(standbys=1)
    with pytest.raises(C.RecoveryImpossible, match="2 failed worker"):
        C.plan_recovery(m, 1, ["w0", "w7"], set(), 4)


def test_dirty_groups_from_survivor_accounting():
    layout = Layout(2, 2, 1)
    holders = {f"w{i}": r for i, r in enumerate(layout.roles())}
    # w0 dp0.pp0, w1 dp0.pp1, w2 dp1.pp0, w3 dp1.pp1

    def acc(coll=0, sent=0, recv=0, pending=0, generation=0):
        return {"coll": coll, "sent": sent, "recv": recv, "pending": pending,
                "generation": generation}

    clean = {
        "w0": {"dp.pp0.tp0": acc(4), "pp.dp0.tp0": acc(2), "p2p.dp0.tp0.pp0-1": acc(0, 6, 6)},
        "w1": {"dp.pp1.tp0": acc(4), "pp.dp0.tp0": acc(2), "p2p.dp0.tp0.pp0-1": acc(0, 6, 6)},
        "w2": {"dp.pp0.tp0": acc(4), "pp.dp1.tp0": acc(2), "p2p.dp1.tp0.pp0-1": acc(0, 6, 6)},
        "w3": {"dp.pp1.tp0": acc(4), "pp.dp1.tp0": acc(2), "p2p.dp1.tp0.pp0-1": acc(0, 6, 6)},
    }
    assert C.dirty_groups(layout, clean, holders) == set()
    broken = {w: dict(g) for w, g in clean.items()}
    broken["w0"]["dp.pp0.tp0"] = acc(5, pending=1)          # waiting in an all-reduce
    broken["w1"]["p2p.dp0.tp0.pp0-1"] = acc(0, 7, 6)        # sent one more than w0 received
    broken["w3"]["pp.dp1.tp0"] = acc(3)                      # one collective ahead of w2
    assert C.dirty_groups(layout, broken, holders) == {
        "dp.pp0.tp0", "p2p.dp0.tp0.pp0-1", "pp.dp1.tp0"}
    # a group with a dead member is left to the failed role's rebuild
    del broken["w0"]
    assert "dp.pp0.tp0" not in C.dirty_groups(layout, broken, holders)


def test_step_watchdog_limit_follows_the_step_time():
    from trainmover.core.accounting import stalled_for

    steady = [0.0, 0.1, 0.2, 0.3, 0.4]              # 0.1 s steps
    assert stalled_for(steady[:3], 100.0, 3, 0.5) is None   # no step time known yet
    assert stalled_for(steady, 0.85, 3, 0.5) is None        # the floor (0.5 s) is not reached
    assert stalled_for(steady, 0.95, 3, 0.5) == pytest.approx(0.55)
    slow = [0.0, 2.0, 4.0, 6.0, 8.0]                # 2 s steps: 3 x 2 s
    assert stalled_for(slow, 13.9, 3, 0.5) is None
    assert stalled_for(slow, 14.1, 3, 0.5) == pytest.approx(6.1)
    # one long gap (a recovery, a checkpoint) does not move the median
    assert stalled_for([0.0, 0.1, 0.2, 5.0, 5.1, 5.2], 5.6, 3, 0.1) == pytest.approx(0.4)


def test_fault_points_of_events_fire_at_or_after_their_step():
    from trainmover.core.faults import hit

    fired = []
    faults = [{"worker": "w1", "point": "prepare", "step": 6, "kind": "commerr"},
              {"worker": "w1", "point": "backward", "step": 6, "kind": "commerr"}]
    for step in (4, 5, 7, 8):
        hit(faults, "w1", "prepare", step, on_commerr=lambda: fired.append(("prepare", step)))
        hit(faults, "w1", "backward", step, on_commerr=lambda: fired.append(("backward", step)))
    hit(faults, "w2", "prepare", 9, on_commerr=lambda: fired.append(("other", 9)))
    # an event point fires at the first pass at or after its step (here 7, and again at 8
    # without a store to record it fired); a step point only at its exact step
    assert fired == [("prepare", 7), ("prepare", 8)]


def test_controller_and_standby_inject_targets():
    workers, standbys = ["w0", "w1"], ["s0"]
    validate_injects([parse_inject("crash@3:controller"),
                      parse_inject("crash@3:controller:recovery"),
                      parse_inject("crash@2:s0:joiner_prepare"),
                      parse_inject("hang@2:w1:switch")], 10, workers, standbys)
    for bad, msg in [("hang@3:controller", "the controller can only crash"),
                     ("crash@3:controller:lunch", "unknown controller point 'lunch'"),
                     ("crash@3:s0:backward", "unknown worker 's0'"),
                     ("crash@3:w1:sideways", "unknown point 'sideways'"),
                     # accepted before, yet they could never fire
                     ("crash@3:w1:standby", "never passes the standby point 'standby'"),
                     ("hang@3:w0:joiner_prepare", "never passes the standby point"),
                     ("commerr@3:w1:checkpoint", "could never fail there"),
                     ("commerr@3:s0:standby", "could never fail there"),
                     ("commerr@3:w0:recover", "could never fail there")]:
        with pytest.raises(ValueError, match=msg):
            validate_injects([parse_inject(bad)], 10, workers, standbys)
