"""The controller's snapshot as JSON: round trips of its real state types, and refusals of
anything that is not plain registered data."""
import json
import pickle

import pytest

from trainmover.control.coordinator import SNAPSHOT_CODEC, ActiveMigration, MigrationRequest
from trainmover.control.processes import AgentClient, ProcView
from trainmover.control.recovery import ActiveRecovery, Failure
from trainmover.core import decisions as C
from trainmover.core.codec import Codec, SnapshotError
from trainmover.core.faults import Inject
from trainmover.core.topology import Layout


def snapshot_like():
    layout = Layout(2, 2, 1)
    m = C.Membership.initial(layout, [f"w{i}" for i in range(4)], ["s0", "s1"])
    m.standbys["s0"] = C.StandbyState.WARM
    plan = C.plan_migration(m, 1, ["w1"])
    req = MigrationRequest(["w1"], None, "cli", store_index=3)
    rec = ActiveRecovery(2, 0, {"w2": Failure("w2", "crash", 12.5, "exit code -9")}, 12.6, 7,
                         reports={"w0": {"accounting": {"dp.pp0.tp0": {"coll": 3}}}})
    rec.plan = C.plan_recovery(m, 2, ["w2"], {"dp.pp0.tp0"}, None)
    procs = AgentClient(None, {"w0": ProcView(False, 1, "/x/w0.log", 123)}, 4)
    return {"membership": m, "pending": [req], "active": ActiveMigration(plan, req),
            "injects": [Inject("migrate", 5, "w3", "s1")], "outbox": [("set", "k", "v")],
            "procs": procs, "recovery": {"failed_workers": {"w5", "w6"}, "active": rec}}


def test_the_controller_state_round_trips_through_json():
    state = snapshot_like()
    text = SNAPSHOT_CODEC.dumps(state)
    back = SNAPSHOT_CODEC.loads(text)
    assert back["membership"] == state["membership"]
    assert back["active"].plan == state["active"].plan
    assert back["active"].state is C.MigrationState.PREPARING
    assert back["pending"][0].workers == ["w1"] and back["pending"][0].store_index == 3
    assert not back["pending"][0].future.done()        # a fresh future, not the old one
    assert back["recovery"]["failed_workers"] == {"w5", "w6"}
    assert back["recovery"]["active"].plan == state["recovery"]["active"].plan
    assert back["recovery"]["active"].failures["w2"] == Failure("w2", "crash", 12.5,
                                                                "exit code -9")
    assert back["procs"].procs["w0"].pid == 123 and back["procs"].store is None
    assert back["injects"] == state["injects"]
    assert SNAPSHOT_CODEC.dumps(back) == text          # stable: a resumed controller re-saves it


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d["membership"].update(__type__="Popen"), "unknown type 'Popen'"),
    (lambda d: d["membership"]["fields"].update(evil=1), "unknown field"),
    (lambda d: d["pending"][0]["fields"].update(store_index="3"), "store_index"),
    (lambda d: d["active"]["fields"]["state"].update(value="exploded"), "exploded"),
])
def test_tampered_snapshots_are_refused(mutate, message):
    data = json.loads(SNAPSHOT_CODEC.dumps(snapshot_like()))
    mutate(data)
    with pytest.raises(SnapshotError, match=message):
        SNAPSHOT_CODEC.loads(json.dumps(data))


def test_only_plain_registered_data_is_written_or_read():
    with pytest.raises(SnapshotError, match="not registered"):
        Codec().dumps(Layout(1, 1, 1))
    with pytest.raises(SnapshotError, match="cannot encode a object"):
        SNAPSHOT_CODEC.dumps({"x": object()})
    with pytest.raises(SnapshotError, match="keys must be strings"):
        SNAPSHOT_CODEC.dumps({1: "a"})
    with pytest.raises(SnapshotError, match="not JSON"):
        SNAPSHOT_CODEC.loads(pickle.dumps({"a": 1}))
    with pytest.raises(SnapshotError, match="exceeds"):
        Codec(max_bytes=10).loads('{"a": "0123456789"}')


# --- commands ------------------------------------------------------------------------------------

from trainmover.core import protocol as P  # noqa: E402

COMMANDS = [
    P.Prepare(3, {"dp.pp0.tp0": 2}),
    P.Leave(3, "s0", "xfer.w1.s0", 3, naive=True),
    P.AssignMigration(3, "dp0.pp1.tp0", 1, "w1", "xfer.w1.s0", 3, {"dp.pp1.tp0": 2}),
    P.AssignRecovery(4, "dp1.pp0.tp0", 2, 12, {}, P.StateSource("replica", "rxfer.w0.s1", 4)),
    P.AssignRecovery(5, "dp0.pp0.tp0", 3, 10, {"pp.dp0.tp0": 4},
                     P.StateSource("checkpoint", step=10)),
    P.Recover(4, 2, 12, None, {"dp.pp0.tp0": 3}, P.SendState("s1", "rxfer.w0.s1", 4)),
    P.Recover(5, 3, 10, 10, {}),
]


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: type(c).__name__)
def test_commands_round_trip(cmd):
    assert P.decode_command(P.encode_command(cmd)) == cmd


@pytest.mark.parametrize("raw, message", [
    ('{"type": "spawn", "argv": ["sh"]}', "unknown command type 'spawn'"),
    ('{"type": "prepare", "migration_id": 1, "groups": {}, "run": "x"}', "unknown field"),
    ('{"type": "prepare", "migration_id": "1", "groups": {}}', "Prepare.migration_id"),
    ('{"type": "prepare", "migration_id": true, "groups": {}}', "Prepare.migration_id"),
    ('{"type": "prepare", "migration_id": 1, "groups": {"g": "x"}}', "Prepare.groups"),
    ('{"type": "prepare", "groups": {}}', "missing 1 required"),
    ('{"type": "recover", "recovery_id": 1, "epoch": 1, "resume_step": 1, "rollback_step": null,'
     ' "groups": {}, "send_state": {"joiner": 5}}', "SendState.joiner"),
    ('{"type": "assign_recovery", "recovery_id": 1, "role": "r", "epoch": 1, "resume_step": 1,'
     ' "groups": {}, "source": {"kind": "disk"}}', "state source kind 'disk'"),
    ("[1, 2]", "unknown command type"),
    ("not json", "not JSON"),
    ('{"type": "prepare", "pad": "' + "x" * P.MAX_MESSAGE_BYTES + '"}', "exceeds"),
])
def test_malformed_commands_are_refused(raw, message):
    with pytest.raises(P.MessageError, match=message):
        P.decode_command(raw)
