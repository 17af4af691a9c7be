"""The controller's snapshot as JSON: round trips of its real state types, and refusals of
anything that is not plain registered data."""
import dataclasses
import json
import pickle

import pytest

from trainmover.control.snapshot_codec import SNAPSHOT_CODEC
from trainmover.control.health import Failure
from trainmover.control.migrations import ActiveMigration, MigrationRequest
from trainmover.control.processes import AgentClient, ProcView
from trainmover.control.recovery import ActiveRecovery
from trainmover.core import decisions as C
from trainmover.core.codec import Codec, SnapshotError
from trainmover.core.faults import Inject
from trainmover.core import protocol as P
from trainmover.core.topology import Layout


def snapshot_like():
    layout = Layout(2, 2, 1)
    m = C.Membership.initial(layout, [f"w{i}" for i in range(4)], ["s0", "s1"])
    m.standbys["s0"] = C.StandbyState.WARM
    plan = C.plan_migration(m, 1, ["w1"])
    req = MigrationRequest(["w1"], None, "cli", store_index=3)
    rec = ActiveRecovery(2, 0, {"w2": Failure("w2", "crash", 12.5, "exit code -9")}, 12.6, 7,
                         reports={"w0": P.FailureReport(7, "reset", False,
                                                        {"dp.pp0.tp0": {"coll": 3}})})
    rec.plan = C.plan_recovery(m, 2, ["w2"], {"dp.pp0.tp0"}, None)
    procs = AgentClient(None, "/x/logs", {"w0": ProcView(False, 1, 0, 123)}, 4)
    return {"membership": m, "pending": [req], "active": ActiveMigration(plan, req),
            "injects": [Inject("migrate", 5, "w3", "s1")],
            "outbox": [("set", "k", "v"), ("agent", 2, P.AgentSpawn("s2", 1, True, gpu=1))],
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
    assert back["recovery"]["active"].reports == state["recovery"]["active"].reports
    assert back["outbox"][1][2] == state["outbox"][1][2]
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

COMMANDS = [
    P.Prepare(3, {"dp.pp0.tp0": 2}),
    P.Leave(3, "s0", "xfer.w1.s0", 3, naive=True),
    P.AssignMigration(3, "dp0.pp1.tp0", 1, "w1", "xfer.w1.s0", 3, {"dp.pp1.tp0": 2}),
    P.AssignRecovery(4, "dp1.pp0.tp0", 2, 12, {}, P.StateSource("replica", "rxfer.w0.s1", 4)),
    P.AssignRecovery(5, "dp0.pp0.tp0", 3, 10, {"pp.dp0.tp0": 4},
                     P.StateSource("checkpoint", step=10)),
    P.Recover(4, 2, 12, None, {"dp.pp0.tp0": 3}, [P.SendState("s1", "rxfer.w0.s1", 4),
                                                   P.SendState("s2", "rxfer.w0.s2", 4, 1, 2)]),
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
     ' "groups": {}, "send_states": [{"joiner": 5}]}', "SendState.joiner"),
    ('{"type": "assign_recovery", "recovery_id": 1, "role": "r", "epoch": 1, "resume_step": 1,'
     ' "groups": {}, "source": {"kind": "disk"}}', "state source kind 'disk'"),
    ("[1, 2]", "unknown command type"),
    ("not json", "not JSON"),
    ('{"type": "prepare", "pad": "' + "x" * P.MAX_MESSAGE_BYTES + '"}', "exceeds"),
])
def test_malformed_commands_are_refused(raw, message):
    with pytest.raises(P.MessageError, match=message):
        P.decode_command(raw)


# --- reports and the agent's requests: everything else on the store -----------------------------

MESSAGES = [
    P.StandbyReport("warm", ["first", "last"]),
    P.StandbyReport("refused", reason="data is not a function of the step"),
    P.FailureReport(12, "Connection reset by peer", True,
                    {"dp.pp0.tp0": {"coll": 3, "sent": 0, "recv": 0, "pending": 1}}),
    P.ReadyReport(0.25, step=9),
    P.ReadyReport(0.5, prepare_s=1.5),
    P.SwitchReport(switch_s=0.01, transfer_s=0.004, transfer_bytes=123456,
                   rss_before={"rss_mb": 100.5}, rss_after={"rss_mb": 101.0}),
    P.MigrationAsk(["w1", "w2"], ["s0", "s1"]),
    P.StepEnds(4, 10, 14, [1700000000.5 + 0.1 * i for i in range(13)]),
    P.ProcRecord(4242, 2),
    P.ExitRecord("w3", 1, -9, 1700000000.5),
    P.ControllerInfo(77, 3),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_messages_round_trip(msg):
    assert P.read_message(type(msg), P.write_message(msg)) == msg


AGENT_REQUESTS = [
    P.AgentSpawn("s3", 2, standby=True, gpu=3),
    P.AgentSpawn("w1", 3, resume_step=12, generation=4, epoch=2),
    P.AgentSignal("w1", 1, "TERM", 3.0),
    P.AgentShutdown(2.0),
    P.AgentNoop(),
]


@pytest.mark.parametrize("req", AGENT_REQUESTS, ids=lambda r: type(r).__name__)
def test_agent_requests_round_trip(req):
    assert P.decode_agent_request(P.encode_agent_request(req)) == req


@pytest.mark.parametrize("cls, raw, message", [
    # the forged request of the security review: without its incarnation it used to raise
    # KeyError in the agent, which hosts the store, and take the job down
    (None, '{"type": "signal", "name": "w1", "signal": "KILL"}', "missing 1 required"),
    # no program, path or environment is ever taken from the store
    (None, '{"type": "spawn", "name": "x", "incarnation": 1, "argv": ["touch", "/tmp/x"]}',
     r"unknown field\(s\) \['argv'\]"),
    (None, '{"type": "spawn", "name": "../../etc", "incarnation": 1}', "process name"),
    (None, '{"type": "spawn", "name": "w1", "incarnation": 1, "gpu": -1}', "negative"),
    (None, '{"type": "spawn", "name": "w1", "incarnation": 1, "epoch": "1; rm"}',
     "AgentSpawn.epoch"),
    (None, '{"type": "signal", "name": "w1", "incarnation": 1, "signal": "HUP"}',
     "signal 'HUP'"),
    (None, '{"type": "exec", "cmd": "sh"}', "unknown agent request type 'exec'"),
    (P.StandbyReport, '{"state": "hot"}', "standby state 'hot'"),
    (P.FailureReport, '{"step": 1, "error": "e", "self_failed": "yes", "accounting": {}}',
     "FailureReport.self_failed"),
    (P.FailureReport, '{"step": 1, "error": "e", "self_failed": false,'
                      ' "accounting": {"g": {"coll": 1.5}}}', "FailureReport.accounting"),
    (P.SwitchReport, '{"transfer_bytes": "many"}', "SwitchReport.transfer_bytes"),
    (P.MigrationAsk, '{"workers": "w1"}', "MigrationAsk.workers"),
    (P.ExitRecord, '{"name": "w1", "incarnation": 1, "code": 0}', "missing 1 required"),
    (P.ProcRecord, '[1]', "expected an object"),
])
def test_malformed_messages_are_refused(cls, raw, message):
    with pytest.raises(P.MessageError, match=message):
        if cls is None:
            P.decode_agent_request(raw)
        else:
            P.read_message(cls, raw)


@pytest.mark.parametrize("change", [
    lambda t: t.__setitem__("w1", 5), lambda t: t.__delitem__("w0"), lambda t: t.pop("w0"),
    lambda t: t.popitem(), lambda t: t.clear(), lambda t: t.update(w9=9),
    lambda t: t.setdefault("w9", 9), lambda t: t.__ior__({"w9": 9})],
    ids=["set", "del", "pop", "popitem", "clear", "update", "setdefault", "ior"])
def test_a_table_is_written_again_exactly_when_it_changed(change):
    """A Table's JSON is kept between two dumps while it did not change: the text is the
    same as a fresh codec's, the table read back is a Table again, and any change made
    through its methods is in the next dumps."""
    from trainmover.core.codec import Table

    codec = Codec()
    table = Table({"w0": 1, "w1": 2})
    state = {"a": table, "b": [table.copy()], "c": "x"}
    first = codec.dumps(state)
    assert first == Codec().dumps(state) == codec.dumps(state)       # kept, then reused
    back = codec.loads(first)
    assert back == state and type(back["a"]) is Table and type(back["b"][0]) is Table
    change(table)
    expected = dict(table)
    again = codec.dumps(state)
    assert codec.loads(again)["a"] == expected and again == Codec().dumps(state)


@pytest.mark.parametrize("seed", range(5))
def test_tables_written_entry_by_entry_and_copies_read_as_a_fresh_codec_writes_them(seed):
    """A changed part of a Table is joined from its entries' JSON, each encoded again only
    when its value is another object, and a copy of a table starts from the JSON of the
    table it copies: whatever the changes (values replaced by equal or other objects, keys
    added and deleted, copies of copies, the source changed after the copy, strings that
    look like the codec's markers), every dumps is the text a fresh codec writes."""
    import random

    from trainmover.core.codec import Table

    rng = random.Random(seed)
    codec = Codec(ProcView)

    def value():
        return rng.choice([rng.randrange(100), f'"x{rng.randrange(9)}:"', None, [1, "a"],
                           ProcView(False, rng.randrange(3), rng.randrange(4),
                                    rng.choice([None, 7]))])

    tables = [Table({f"w{i}": value() for i in range(rng.randrange(1, 400))})]
    state = {"t": tables}
    for i in range(120):
        if i % 2 and rng.random() < 0.5:      # a few changes between two dumps at times
            text = codec.dumps(state)
            assert text == Codec(ProcView).dumps(state)
            assert codec.loads(text) == {"t": [dict(x) for x in tables]}
        t = rng.choice(tables)
        op = rng.randrange(6)
        keys = list(t)
        if op == 0 or not keys:
            for _ in range(rng.randrange(1, 50)):
                t[f"w{rng.randrange(600)}"] = value()
        elif op == 1:
            for k in rng.sample(keys, min(len(keys), rng.randrange(1, 30))):
                del t[k]
        elif op == 2:     # the same value again: the entry is kept
            for k in rng.sample(keys, min(len(keys), 20)):
                t[k] = t[k]
        elif op == 3:     # an equal value, another object
            for k in rng.sample(keys, min(len(keys), 20)):
                t[k] = dataclasses.replace(t[k]) if isinstance(t[k], ProcView) else \
                    json.loads(json.dumps(t[k]))
        elif op == 4 and len(tables) < 6:
            tables.append(t.copy())
        elif op == 5 and len(tables) > 1:
            tables.remove(t)
    with pytest.raises(SnapshotError, match="keys must be strings"):
        tables[0]["__bad"] = 1
        codec.dumps(state)


def test_a_string_like_a_tables_placeholder_is_left_as_it_is():
    """Tables are spliced into the text by a placeholder carrying a random nonce: no string
    of the state (a worker's error message) is taken for one, nor a table nested in one."""
    from trainmover.core.codec import Table

    codec = Codec()
    state = {"t": Table({"k": Table({"n": 1})}), "msg": "table::0", "m2": "table:0"}
    text = codec.dumps(state)
    assert codec.loads(text) == state and codec.loads(codec.dumps(state)) == state


def test_the_big_tables_of_the_controllers_state_are_tables_after_a_round_trip():
    """Membership's tables and the process table are Tables, in a copy and read back (so a
    resumed controller keeps reusing their JSON); one read from an older snapshot (plain
    objects) becomes Tables too."""
    from trainmover.core.codec import Table

    state = snapshot_like()
    back = SNAPSHOT_CODEC.loads(SNAPSHOT_CODEC.dumps(state))
    for m in (state["membership"], state["membership"].copy(), back["membership"]):
        assert all(type(getattr(m, f)) is Table
                   for f in ("workers", "standbys", "generations", "next_generation"))
    assert type(back["procs"].procs) is Table
    old = json.loads(SNAPSHOT_CODEC.dumps(state))
    old["procs"]["fields"]["procs"] = old["procs"]["fields"]["procs"]["__table__"]
    assert type(SNAPSHOT_CODEC.decode(old)["procs"].procs) is Table


# --- tables as parts --------------------------------------------------------------------------

def _parts_of(codec, state, part_min_bytes=0):
    parts = {}
    return codec.dumps(state, parts, part_min_bytes), parts


@pytest.mark.parametrize("change,most_new", [
    (lambda t: t.__setitem__("w1", 5), 1), (lambda t: t.__delitem__("w0"), 1),
    (lambda t: t.clear(), 0), (lambda t: t.update({f"x{i}": i for i in range(50)}), 64)],
    ids=["set", "del", "clear", "grow"])
def test_a_table_written_as_parts_reads_back_and_a_change_writes_only_its_part(
        change, most_new):
    """Parts name by digest what the text leaves out; read back through a fetch, the state
    is the same as from the whole text. A change of one entry gives at most one new part;
    the parts it did not touch keep their digests and strings."""
    from trainmover.core.codec import Table

    codec = Codec()
    table = Table({f"w{i}": i for i in range(300)})
    state = {"a": table, "b": [Table({"k": 1})], "c": "x"}
    text, parts = _parts_of(codec, state)
    assert len(parts) > 32 and "w299" not in text
    back = codec.loads(text, lambda refs: {d: parts[d] for d in refs})
    assert back == state == codec.loads(codec.dumps(state)) and type(back["a"]) is Table
    change(table)
    text2, parts2 = _parts_of(codec, state)
    back = codec.loads(text2, lambda refs: {d: parts2[d] for d in refs})
    assert back == {"a": dict(table), "b": [{"k": 1}], "c": "x"} and type(back["a"]) is Table
    assert len(set(parts2) - set(parts)) <= most_new
    assert all(parts[d] == parts2[d] for d in set(parts2) & set(parts))


def test_only_tables_past_the_size_are_parts():
    from trainmover.core.codec import Table

    codec = Codec()
    state = {"big": Table({f"w{i}": "x" * 20 for i in range(200)}), "small": Table({"k": 1})}
    text, parts = _parts_of(codec, state, part_min_bytes=2000)
    assert '"small":{"__table__":{"k":1}}' in text and "w1" not in text
    text, parts = _parts_of(codec, state, part_min_bytes=10**9)
    assert parts == {} and text == codec.dumps(state)


def test_a_missing_changed_or_malformed_part_is_refused():
    """A part not fetched, one that is not what its digest names (junk in a copy), a list
    of parts that is not digests, a part that smuggles a reserved key, and a text that names
    parts read without a source of parts: each refused naming the problem."""
    from trainmover.core.codec import Table, part_digest

    codec = Codec()
    text, parts = _parts_of(codec, {"a": Table({f"w{i}": i for i in range(100)})})
    some = sorted(parts)[0]
    with pytest.raises(SnapshotError, match=f"part {some} is missing"):
        codec.loads(text, lambda refs: {d: parts[d] for d in refs if d != some})
    with pytest.raises(SnapshotError, match=f"part {some} does not match"):
        codec.loads(text, lambda refs: {**{d: parts[d] for d in refs}, some: '"w0":7'})
    with pytest.raises(SnapshotError, match="no source of parts"):
        codec.loads(text)
    for bad in (['x' * 32], "abc", [1], [some.upper()]):
        forged = json.dumps({"a": {"__table__": {"__parts__": bad}}})
        with pytest.raises(SnapshotError, match="not a list of digests"):
            codec.loads(forged, lambda refs: {})
    sneaky = '"__type__":"Role"'
    forged = json.dumps({"a": {"__table__": {"__parts__": [part_digest(sneaky)]}}})
    with pytest.raises(SnapshotError, match="reserved key"):
        codec.loads(forged, lambda refs: {part_digest(sneaky): sneaky})
