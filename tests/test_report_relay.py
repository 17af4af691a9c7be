"""The survivors' failure reports on their way (``agent/reports.py``, ``control/health.py``):
a worker sends its report on its channel, its agent writes the host's reports of the epoch
as one signed ``HostReports`` and adds their number to the epoch's count, and the
controller reads a worker's report only from its own host's value. On a real store in this
process, the channels real socket pairs, the agent's reader and relay thread the real
ones."""
import socket
import time
from types import SimpleNamespace

import pytest

from trainmover.agent.reports import Reports
from trainmover.agent.votes import Channels
from trainmover.comm.groups import start_store_server
from trainmover.control.host_notes import (RecoveredNotes, read_failure_reports,
                                           read_recovery_notes)
from trainmover.core import protocol as P
from trainmover.core.auth import AuthStore

from mp_harness import wait_for

SECRET = b"f" * 64
DEADLINE_S = 20


@pytest.fixture
def server():
    server = start_store_server(timeout_s=20, run_key=SECRET)
    yield server
    server.close()


def report(step: int, error: str = "aborted") -> P.FailureReport:
    return P.FailureReport(step, error, False, {"dp": {"coll": 3, "sent": 0, "recv": 0,
                                                      "pending": 0, "generation": 0}})


def test_a_hosts_reports_reach_the_store_as_one_value_and_one_count(server):
    """Two processes report on their channels: one ``HostReports`` with both, written once
    both came, and one add of 2 to the count. A third process that never reports (it
    failed) holds nothing up beyond the coalescing time. A late report rewrites the value
    with it and adds 1; junk on a channel is reported and left out."""
    store = AuthStore(server.client(), SECRET)
    writes = []
    real_set = store.set
    store.set = lambda key, value: (writes.append(key), real_set(key, value))
    rejected = []
    expected = {"w0", "w1"}
    relay = Reports(store, 3, 0.05, lambda: set(expected),
                    on_reject=lambda name, why: rejected.append(name))
    ends = {}
    channels = Channels(lambda *a: None, on_report=lambda child, epoch, raw:
                        relay.received(child.name, epoch, raw))
    for name in ("w0", "w1", "w2"):
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        mine.setblocking(False)
        ends[name] = theirs
        channels.add(SimpleNamespace(name=name, channel=mine, beats=0, beat_at=0.0))
    ends["w0"].send(P.report_message(5, report(40)))
    time.sleep(0.02)
    assert writes == []                      # w1 not yet: within the coalescing time
    ends["w1"].send(P.report_message(5, report(40, "reset")))
    key = P.host_reports_key(3, 5)
    wait_for(lambda: store.valid(key), DEADLINE_S, "host 3's reports of epoch 5")
    host = P.read_message(P.HostReports, store.valid(key))
    assert host.epoch == 5 and set(host.reports) == {"w0", "w1"}
    assert host.reports["w1"].error == "reset" and writes == [key]
    assert store.add(P.failure_count_key(5), 0) == 2
    # a process that is expected but never reports: written after the coalescing time
    expected.add("w2")
    ends["w0"].send(P.report_message(6, report(41)))
    wait_for(lambda: store.valid(P.host_reports_key(3, 6)), DEADLINE_S,
             "the reports of epoch 6 after the coalescing time")
    # a late report of epoch 5: the value again, with it; the count one more
    ends["w2"].send(P.report_message(5, report(40)))
    wait_for(lambda: store.add(P.failure_count_key(5), 0) == 3, DEADLINE_S, "the late report")
    assert set(P.read_message(P.HostReports, store.valid(key)).reports) == \
        {"w0", "w1", "w2"}
    ends["w2"].send(b"f 5 {not json")
    wait_for(lambda: rejected == ["w2"], DEADLINE_S, "the junk report's rejection")
    assert relay.error is None


def test_a_hosts_notes_of_a_recovery_done_reach_the_store_as_one_add(server):
    """Two processes note recovery 7 done on their channels: one add of 2 to its count,
    once both came. A note sent twice counts once; a joiner's note (not expected: it was a
    standby), after the coalescing time, adds 1 more; junk is left out."""
    store = AuthStore(server.client(), SECRET)
    adds = []
    real_add = store.add
    store.add = lambda key, n: (adds.append((key, n)), real_add(key, n))[1]
    relay = Reports(store, 1, 0.05, lambda: {"w0", "w1"})
    ends = {}
    channels = Channels(lambda *a: None, on_recovered=lambda child, rid:
                        relay.recovered(child.name, rid))
    for name in ("w0", "w1", "j0"):
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        mine.setblocking(False)
        ends[name] = theirs
        channels.add(SimpleNamespace(name=name, channel=mine, beats=0, beat_at=0.0))
    key = P.recovered_count_key(7)
    ends["w0"].send(P.recovered_message(7))
    ends["w0"].send(P.recovered_message(7))
    time.sleep(0.02)
    assert adds == []                        # w1 not yet: within the coalescing time
    ends["w1"].send(P.recovered_message(7))
    wait_for(lambda: adds, DEADLINE_S, "host 1's add to recovery 7's count")
    assert adds == [(key, 2)]
    ends["w0"].send(P.recovered_message(7))        # again, after its add: not counted
    ends["j0"].send(P.recovered_message(7))
    ends["j0"].send(b"r x")
    wait_for(lambda: len(adds) == 2, DEADLINE_S, "the joiner's note")
    time.sleep(0.1)
    assert adds == [(key, 2), (key, 1)] and store.add(key, 0) == 3
    # each add after the host's signed note naming everyone counted so far
    note = P.read_message(P.HostRecovered, store.valid(P.host_recovered_key(1, 7)))
    assert note == P.HostRecovered(7, ["j0", "w0", "w1"])
    assert relay.error is None


def note_ctx(store, hosts):
    events = []
    return SimpleNamespace(store=store, hosts=hosts,
                           events=SimpleNamespace(emit=lambda e, **kw: events.append(e))), events


def test_the_controller_takes_a_workers_note_only_from_its_own_hosts_value(server):
    """Host 0's note names w0 and, forged in, w1 (host 1's): only w0 counts from it. An
    unsigned note, one of another recovery and a worker with no known host (its own key)."""
    store = AuthStore(server.client(), SECRET)
    ctx, events = note_ctx(store, {"w0": 0, "w1": 1, "w2": 2})
    store.set(P.host_recovered_key(0, 3), P.write_message(P.HostRecovered(3, ["w0", "w1"])))
    server.client().set(P.host_recovered_key(1, 3), P.write_message(
        P.HostRecovered(3, ["w1"])))
    store.set(P.host_recovered_key(2, 3), P.write_message(P.HostRecovered(2, ["w2"])))
    store.set(P.own_recovered_key(3, "w9"), P.write_message(P.HostRecovered(3, ["w9", "w8"])))
    assert read_recovery_notes(ctx, 3, ["w0", "w1", "w2", "w8", "w9"]) == {"w0", "w9"}
    assert "message_rejected" in events       # the other recovery's note
    store.set(P.host_recovered_key(1, 3), P.write_message(P.HostRecovered(3, ["w1"])))
    assert read_recovery_notes(ctx, 3, ["w1"]) == {"w1"}


def test_a_forged_count_neither_ends_a_recovery_early_nor_keeps_it_from_ending(server):
    """The count is a hint. Pushed up past the participants by someone past the store's
    handshake: not done while the notes are short (said once), done as soon as the last
    genuine note's add moves it. Pushed down after every note came: done at the next
    recheck anyway."""
    store = AuthStore(server.client(), SECRET)
    forger = server.client()
    ctx, events = note_ctx(store, {"w0": 0, "w1": 0, "w2": 1, "j0": 1})
    notes = RecoveredNotes(ctx, recheck_s=0.3)
    everyone = {"w0", "w1", "w2", "j0"}
    forger.add(P.recovered_count_key(5), 10)
    assert not notes.all_done(5, everyone) and not notes.all_done(5, everyone)
    assert events.count("recovered_count_ahead") == 1
    store.set(P.host_recovered_key(0, 5), P.write_message(P.HostRecovered(5, ["w0", "w1"])))
    store.add(P.recovered_count_key(5), 2)
    store.set(P.host_recovered_key(1, 5), P.write_message(P.HostRecovered(5, ["w2"])))
    store.add(P.recovered_count_key(5), 1)
    assert not notes.all_done(5, everyone)          # j0's note is not there yet
    store.set(P.host_recovered_key(1, 5), P.write_message(P.HostRecovered(5, ["j0", "w2"])))
    store.add(P.recovered_count_key(5), 1)
    assert notes.all_done(5, everyone)
    # recovery 6: every note came, and the count was pushed down under them
    store.set(P.host_recovered_key(0, 6), P.write_message(P.HostRecovered(6, ["w0", "w1"])))
    store.set(P.host_recovered_key(1, 6), P.write_message(P.HostRecovered(6, ["j0", "w2"])))
    store.add(P.recovered_count_key(6), 4)
    forger.add(P.recovered_count_key(6), -3)
    assert not notes.all_done(6, everyone)          # the count says 1: no read yet
    wait_for(lambda: notes.all_done(6, everyone), DEADLINE_S, "the recheck of recovery 6")


def test_the_controller_reads_a_workers_report_only_from_its_own_hosts_value(server):
    """Host 0's value names w0 and, forged in, w1 (which runs on host 1): only w0's is
    taken from it. An unsigned value, one of another epoch and a worker with no known host
    (read from its own key, as a process no agent started writes it) are covered too."""
    store = AuthStore(server.client(), SECRET)
    events = []
    ctx = SimpleNamespace(store=store, hosts={"w0": 0, "w1": 1, "w2": 2},
                          events=SimpleNamespace(emit=lambda e, **kw: events.append(e)))
    store.set(P.host_reports_key(0, 4), P.write_message(P.HostReports(4, {
        "w0": report(9), "w1": report(9, "forged")})))
    server.client().set(P.host_reports_key(1, 4), P.write_message(P.HostReports(4, {
        "w1": report(9, "unsigned")})))
    store.set(P.host_reports_key(2, 4), P.write_message(P.HostReports(3, {
        "w2": report(9, "old epoch")})))
    store.set(P.failure_key(4, "w9"), P.write_message(report(9, "own key")))
    got = read_failure_reports(ctx, 4, ["w0", "w1", "w2", "w9"])
    assert set(got) == {"w0", "w9"} and got["w9"].error == "own key"
    assert "message_rejected" in events       # the other epoch's value
    store.set(P.host_reports_key(1, 4), P.write_message(P.HostReports(4, {
        "w1": report(9, "genuine")})))
    assert read_failure_reports(ctx, 4, ["w1"])["w1"].error == "genuine"


def test_a_process_silent_after_an_abort_is_named_by_its_agent_timed_on_the_host(server):
    """An epoch's abort reaches the relay; w0 reports at once, w1 never: the host's value
    goes with w0's report (w1 not named yet: within the timeout), then, the timeout after
    the abort as the agent saw it, again naming w1 silent, without adding to the count. A
    report w1 sends after that rewrites the value with it and names nobody."""
    store = AuthStore(server.client(), SECRET)
    relay = Reports(store, 2, 0.005, lambda: {"w0", "w1"}, silent_after_s=0.5)
    key = P.host_reports_key(2, 7)
    t0 = time.monotonic()
    relay.aborted(7)
    relay.received("w0", 7, P.write_message(report(12)).encode())
    wait_for(lambda: store.valid(key), DEADLINE_S, "w0's report")
    first = P.read_message(P.HostReports, store.valid(key))
    assert set(first.reports) == {"w0"} and first.silent == []
    wait_for(lambda: P.read_message(P.HostReports, store.valid(key)).silent, DEADLINE_S,
             "w1 named silent")
    assert time.monotonic() - t0 >= 0.5
    named = P.read_message(P.HostReports, store.valid(key))
    assert named.silent == ["w1"] and set(named.reports) == {"w0"}
    assert store.add(P.failure_count_key(7), 0) == 1
    relay.received("w1", 7, P.write_message(report(12)).encode())
    wait_for(lambda: "w1" in P.read_message(P.HostReports, store.valid(key)).reports,
             DEADLINE_S, "w1's late report")
    assert P.read_message(P.HostReports, store.valid(key)).silent == []
    # a host none of whose processes reports: its word still comes (its agent is there)
    relay.aborted(8)
    wait_for(lambda: store.valid(P.host_reports_key(2, 8)), DEADLINE_S, "epoch 8's word")
    assert P.read_message(P.HostReports, store.valid(P.host_reports_key(2, 8))).silent == \
        ["w0", "w1"]


def test_the_controller_takes_a_workers_silence_only_from_its_own_hosts_value(server):
    """Host 0's agent names w0 and, forged in, w1 (host 1's) silent: only w0 is taken; a
    worker named silent that also reported is not silent."""
    store = AuthStore(server.client(), SECRET)
    ctx = SimpleNamespace(store=store, hosts={"w0": 0, "w1": 1, "w2": 0},
                          events=SimpleNamespace(emit=lambda e, **kw: None))
    store.set(P.host_reports_key(0, 4), P.write_message(P.HostReports(
        4, {"w2": report(9)}, ["w0", "w1", "w2"])))
    silent: set[str] = set()
    got = read_failure_reports(ctx, 4, ["w0", "w1", "w2"], silent)
    assert set(got) == {"w2"} and silent == {"w0"}


def test_report_messages_round_trip_and_refuse_what_is_not_one():
    assert P.read_recovered_message(P.recovered_message(31)) == 31
    for bad in (b"r", b"r x", b"r -1", b"f 1", b"r 1 2", b"r " + b"9" * 19):
        assert P.read_recovered_message(bad) is None
    raw = P.report_message(12, report(3))
    epoch, payload = P.read_report_message(raw)
    assert epoch == 12 and P.read_message(P.FailureReport, payload) == report(3)
    for bad in (b"f x {}", b"f {}", b"p 1 {}", b"f 1", b""):
        assert P.read_report_message(bad) is None
    with pytest.raises(P.MessageError, match="over the channel"):
        P.report_message(1, report(3, "e" * P.CHANNEL_MAX))
