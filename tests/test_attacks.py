"""The control plane under attack (issue #22): another local user who reaches the store's
port writes whatever they like at a heartbeat key or at the controller's snapshot key. A
frozen worker must not look alive through it, and a restarted controller must not be
stopped by it (docs/security.md)."""
import os
import signal
import socket
import threading
import time
from types import SimpleNamespace

import pytest

from trainmover.comm.groups import start_store_server
from trainmover.control import health as H
from trainmover.control import snapshot_codec as S
from trainmover.control.context import JobContext
from trainmover.core import decisions as C
from trainmover.core import protocol as P
from trainmover.core.auth import AuthStore, seal
from trainmover.core.config import HealthConfig
from trainmover.core.proc import pid_alive
from trainmover.worker.liveness import Heartbeat

from mp_harness import wait_for
import test_failover
from test_failover import STEPS, events, start_controller, steps_done, summary_of
from test_failures import job

baseline = test_failover.baseline    # the uninterrupted run's weights (a fixture)

KEY = b"k" * 64            # the run's key, as a test gives it
OTHER_RUN = b"o" * 64


@pytest.fixture
def server():
    srv = start_store_server(timeout_s=10, run_key=KEY)
    yield srv
    srv.close()


def client(server):
    """A client of the store that signs nothing: what gets in past the store's handshake
    (the job's own processes) writing what no process of the job writes."""
    return server.client()


class Clock:
    def __init__(self):
        self.now = 1000.0

    def time(self):
        return self.now


class Events:
    def __init__(self):
        self.emitted = []

    def emit(self, event, **fields):
        self.emitted.append((event, fields))


def controller_ctx(server, pids: dict[str, int], nnodes: int = 1):
    """What the controller's ``Health`` reads through: its own signed client, ``ctx.read``,
    the processes' PIDs."""
    ctx = SimpleNamespace(events=Events(), progress=SimpleNamespace(say=lambda text: None),
                          cmd_next={})
    ctx.store = AuthStore(client(server), KEY, on_reject=lambda key, exc: ctx.events.emit(
        "message_rejected", key=key, error=str(exc)))
    ctx.read = lambda cls, key: JobContext.read(ctx, cls, key)
    ctx.cfg = SimpleNamespace(health=HealthConfig(
        check_interval_s=0.0, heartbeat_interval_s=0.25, heartbeat_timeout_s=2.0,
        startup_timeout_s=30.0), process=SimpleNamespace(etcd=""))
    procs = {name: SimpleNamespace(node=0, incarnation=1, code=None, pid=pid)
             for name, pid in pids.items()}
    lost = []
    ctx.procs = SimpleNamespace(procs=procs, lost=lost, nnodes=nnodes, known=procs.__contains__,
                                running=lambda name: True, pid=lambda name: procs[name].pid,
                                learn_pids=lambda names: None,
                                mark_lost=lambda node: lost.append(node) or [])
    ctx.membership = SimpleNamespace(standbys={name: C.StandbyState.RESERVED for name in pids})
    return ctx


def rejected(ctx, key):
    return [f for e, f in ctx.events.emitted if e == "message_rejected" and f["key"] == key]


def test_only_genuine_newer_beats_move_a_heartbeat(monkeypatch, server):
    """A process stops beating (frozen): its host's agent goes on writing the host's beat,
    that process's count standing still. Whatever anyone else writes at the host's key is
    no beat: junk, an unsigned beat with the count moved on, a beat signed for another run,
    a counter bumped (the old heartbeat's attack), the host's own older beat put back. It is
    found hung after the heartbeat timeout while its neighbour lives on, and the forged
    values are reported once for the key. Its next genuine beat counts again."""
    clock = Clock()
    monkeypatch.setattr(H, "time", clock)
    ctx = controller_ctx(server, {"s0": 41, "s1": 42})
    health = H.Health(ctx)
    agent, attacker = AuthStore(client(server), KEY), client(server)
    key = P.agent_key(0, "hb")
    seq = iter(range(1, 10**6))

    def host_beat(s0_beat_at=None):
        """The agent's beat now: s0 listed as quiet since ``s0_beat_at`` (None: it beat just
        now), s1 beating."""
        quiet = {} if s0_beat_at is None else {"s0": [41, int((clock.now - s0_beat_at) * 1000)]}
        agent.set(key, P.write_message(P.HostBeat(next(seq), 77, 2, quiet)))

    host_beat()
    first = attacker.get(key)                        # captured by whoever reads the store
    assert health._beat("s0") == 1000.0
    clock.now += 1.0
    host_beat()
    assert health._beat("s0") == 1001.0 and health.hung_standbys() == []
    moved_on = P.write_message(P.HostBeat(10**6, 77, 2, {}))     # s0 heard again
    forgeries = [
        lambda: attacker.set(key, "junk"),
        lambda: attacker.set(key, moved_on),                                     # unsigned
        lambda: attacker.set(key, seal(OTHER_RUN, key, moved_on)),
        lambda: (attacker.delete_key(key), attacker.add(key, 5),                 # a counter
                 attacker.add(key, 1)),
        lambda: attacker.set(key, "123456"),                                     # unsigned
        lambda: attacker.set(key, first),                                        # replayed
    ]
    for forge in forgeries:
        clock.now += 0.3
        forge()
        assert health._beat("s0") == pytest.approx(1001.0)   # the last genuine beat
        host_beat(1001.0)                              # the agent: s0 quiet, s1 on
        assert health._beat("s0") == pytest.approx(1001.0)
        assert health._beat("s1") == clock.now
    clock.now = 1001.0 + ctx.cfg.health.heartbeat_timeout_s + 0.5
    host_beat(1001.0)                                  # the other one lives on
    hung = health.hung_standbys()
    assert [name for name, _ in hung] == ["s0"] and "no heartbeat for 2.50 s" in hung[0][1]
    assert len(rejected(ctx, key)) == 1, ctx.events.emitted        # once per key
    clock.now += 1.0
    host_beat()                                        # it beats again
    assert health._beat("s0") == clock.now


def test_a_bumped_counter_at_an_agents_heartbeat_does_not_hide_a_lost_host(
        monkeypatch, server):
    """Host 1's agent beats, then its host dies; someone keeps bumping (and setting) its
    heartbeat key as a counter. The host is declared lost after the heartbeat timeout."""
    clock = Clock()
    monkeypatch.setattr(H, "time", clock)
    ctx = controller_ctx(server, {}, nnodes=2)
    health = H.Health(ctx)
    agent, attacker = AuthStore(client(server), KEY), client(server)
    key = P.agent_key(1, "hb")
    for seq in (1, 2):
        agent.set(key, P.write_message(P.HostBeat(seq, 77)))
        assert health._check_hosts(clock.now, set(), set()) == set()
        clock.now += 0.25
    attacker.delete_key(key)
    lost_at = None
    for i in range(16):                               # 4 s of forged beats
        attacker.add(key, 1) if i % 2 else attacker.set(key, str(1000 + i))
        clock.now += 0.25
        if health._check_hosts(clock.now, set(), set()) == {1}:
            lost_at = clock.now
            break
    # silent since its last genuine beat, at 1000.25
    assert lost_at == 1000.25 + ctx.cfg.health.heartbeat_timeout_s + 0.25
    (declared,) = [f for e, f in ctx.events.emitted if e == "host_lost"]
    assert "its agent's heartbeat stopped" in declared["reason"]


def test_a_worker_beats_on_its_own_channel_to_the_agent_not_in_the_store():
    """What the worker's heartbeat thread sends: a message a beat on its channel to the
    agent (a socket pair the agent made; nothing in the store, nothing another process can
    write), and nothing once the main thread is stalled."""
    agent_end, worker_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    progress = SimpleNamespace(stalled_s=lambda: 0.0)
    beat = Heartbeat(worker_end, "w9", 0.01, progress, stall_s=5.0)
    agent_end.settimeout(10)
    assert [agent_end.recv(16) for _ in range(3)] == [b"b"] * 3
    progress.stalled_s = lambda: 6.0             # wedged: it falls silent
    # the beats sent before (and at most one under way) are read until a pause of 0.5 s,
    # then none comes (a fixed sleep here once failed on a loaded machine)
    agent_end.settimeout(0.5)
    deadline = time.monotonic() + 20
    while True:
        try:
            agent_end.recv(16)
        except socket.timeout:
            break
        assert time.monotonic() < deadline, "it kept beating"
    with pytest.raises(socket.timeout):
        agent_end.recv(16)
    assert beat.channel is worker_end


# --- the controller's snapshot ----------------------------------------------------------------

def saved(run_dir, server, seq, state, store_value=None):
    """A save as the controller makes it: the run dir's copy, then the store's."""
    payload = S.frame(seq, S.SNAPSHOT_CODEC.dumps(state))
    S.write_file(run_dir, KEY, payload)
    AuthStore(client(server), KEY).set(P.CONTROLLER_SNAPSHOT_KEY, payload)
    return payload


def test_the_newest_genuine_snapshot_copy_is_read(tmp_path, server):
    """Junk, an unsigned snapshot, or an older genuine one put back at the store's key: the
    run dir's copy is read. A newer store copy (written after the file, by a save the
    controller died in) wins over the file; another run's file is passed over; neither
    usable: an error naming both."""
    run_dir = str(tmp_path)
    store, attacker = AuthStore(client(server), KEY), client(server)
    old = saved(run_dir, server, 1, {"committed": 1})
    saved(run_dir, server, 2, {"committed": 2})
    assert S.read_newest(run_dir, store, KEY)[:2] == (2, {"committed": 2})
    for junk in ("junk", S.frame(9, S.SNAPSHOT_CODEC.dumps({"committed": 99})),
                 seal(KEY, P.CONTROLLER_SNAPSHOT_KEY, old) + b" "):
        attacker.set(P.CONTROLLER_SNAPSHOT_KEY, junk)
        seq, state, why = S.read_newest(run_dir, store, KEY)
        assert (seq, state) == (2, {"committed": 2}) and why[0].startswith("the store's copy")
    store.set(P.CONTROLLER_SNAPSHOT_KEY, old)          # genuine, but older: replayed
    assert S.read_newest(run_dir, store, KEY)[:2] == (2, {"committed": 2})
    # a save the controller died in: its store copy is newer than its file
    store.set(P.CONTROLLER_SNAPSHOT_KEY, S.frame(3, S.SNAPSHOT_CODEC.dumps({"committed": 3})))
    assert S.read_newest(run_dir, store, KEY)[:2] == (3, {"committed": 3})
    # a file of another run (a stopped job resumed): its key is not this run's
    S.write_file(run_dir, OTHER_RUN, S.frame(7, S.SNAPSHOT_CODEC.dumps({"committed": 7})))
    seq, _, why = S.read_newest(run_dir, store, KEY)
    assert seq == 3 and len(why) == 1 and why[0].startswith("the run dir's copy") and \
        "bad signature" in why[0]
    saved(run_dir, server, 4, {"committed": 4})
    attacker.set(P.CONTROLLER_SNAPSHOT_KEY, "junk")
    with pytest.raises(ValueError, match="no usable controller snapshot.*not signed.*"
                                         "bad signature"):
        S.read_newest(run_dir, AuthStore(client(server), OTHER_RUN), OTHER_RUN)
    os.unlink(S.file_path(run_dir))
    os.symlink(os.path.join(run_dir, "elsewhere"), S.file_path(run_dir))
    with pytest.raises(ValueError, match="symlink"):
        S.read_newest(run_dir, store, KEY)


def test_the_controller_saves_its_snapshot_in_the_run_dir_too(tmp_path, server):
    """Every save goes to both copies, numbered; junk at the store's key then leaves the
    newest state readable. A save that cannot write the file removes the stale one."""
    from trainmover.control.coordinator import Coordinator
    from trainmover.core.events import EventLog, read_jsonl

    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir, mode=0o700)
    co = Coordinator(job(), run_dir, quiet=True)
    co._run_key = KEY
    co.ctx.membership = C.Membership.initial(co.cfg.layout, ["w0", "w1", "w2", "w3"], ["s0"])
    co.ctx.store = AuthStore(client(server), KEY)
    co.ctx.events = EventLog(os.path.join(run_dir, "events.jsonl"), worker="coordinator")
    co._flush(force=True)
    co._flush(force=True)                             # unchanged: not saved again
    seq, state, why = S.read_newest(run_dir, co.ctx.store, KEY)
    assert seq == 1 and why == [] and state["ctx"]["committed"] == -1
    co.ctx.committed = 41
    co._flush(force=True)
    client(server).set(P.CONTROLLER_SNAPSHOT_KEY, "junk")
    seq, state, _ = S.read_newest(run_dir, co.ctx.store, KEY)
    assert seq == 2 and state["ctx"]["committed"] == 41
    # the file cannot be written (here: a folder in the way of its temporary file)
    os.mkdir(f"{S.file_path(run_dir)}.tmp.{os.getpid()}")
    co.ctx.committed = 42
    co._flush(force=True)
    assert not os.path.exists(S.file_path(run_dir))   # no stale copy left behind
    seq, state, _ = S.read_newest(run_dir, co.ctx.store, KEY)
    assert seq == 3 and state["ctx"]["committed"] == 42
    assert [e for e in read_jsonl(os.path.join(run_dir, "events.jsonl"))
            if e["event"] == "snapshot_file_not_written"]


def test_a_snapshot_kept_as_parts_writes_changed_parts_only_and_survives_junk_in_one_copy(
        tmp_path, server):
    """With every table kept as parts (``controller.snapshot_part_min_bytes`` 0): a save
    that changed no table writes no part; a table change writes its changed parts, and a
    part no save of the last two names is deleted from both copies. Junk at a part's key,
    or a part file removed, leaves the other copy to read."""
    run_dir, coordinator, in_store, in_files = _parts_job(tmp_path, server)
    co = coordinator()
    owner = co.saver.parts_of
    written = []                                        # (copy, digests) of each write
    for copy in (co.saver.store_parts, co.saver.file_parts):
        def spy(digests, parts, copy=copy, real=copy._write):
            written.append((type(copy).__name__, set(digests)))
            real(digests, parts)
        copy._write = spy
    co._flush(force=True)
    first = set(co.saver.store_parts.present)
    assert first and in_store(owner, first) == first == in_files(owner, first)
    assert sorted(written) == [("FileParts", first), ("StoreParts", first)]
    co.ctx.committed = 7                                # no table changed
    written.clear()
    co._flush(force=True)
    assert co.saver.saves == 2 and written == []
    m = co.ctx.membership.copy()
    m.workers["w1"], m.workers["w2"] = m.workers["w2"], m.workers["w1"]
    co.ctx.membership = m                               # a swap: its parts change
    co._flush(force=True)
    second = set(co.saver.store_parts.present)
    assert written and all(d == second - first for _, d in written) and len(written) == 2
    gone = first - co.saver._named_before
    assert gone and in_store(owner, gone) == gone       # named by the save before: kept
    co.ctx.committed = 8
    co._flush(force=True)                               # two saves on: deleted
    assert in_store(owner, gone) == set() == in_files(owner, gone)
    seq, state, why = S.read_newest(run_dir, co.ctx.store, KEY)
    assert seq == 4 and why == [] and state["ctx"]["membership"].workers["w1"] == m.workers["w1"]
    # junk at one part's key: the store's copy is passed over, the run dir's read
    some = sorted(co.saver._named_before)[0]
    client(server).set(S.part_key(owner, some), "junk")
    seq, state, why = S.read_newest(run_dir, co.ctx.store, KEY)
    assert seq == 4 and why[0].startswith("the store's copy") and some in why[0]
    # and a part file removed as well: neither copy is whole
    os.unlink(S.part_file(run_dir, owner, some))
    with pytest.raises(ValueError, match=f"part {some} is missing"):
        S.read_newest(run_dir, co.ctx.store, KEY)
    co.saver.store_parts.present.discard(some)          # (as if never written here)
    co.saver.file_parts.present.discard(some)
    co.ctx.committed = 9
    co._flush(force=True)                               # the part is written again
    assert S.read_newest(run_dir, co.ctx.store, KEY)[0] == 5


def test_a_resumed_controller_writes_its_own_parts_and_deletes_its_predecessors_later(
        tmp_path, server):
    """Each controller writes its parts under a name of its own: a superseded one still
    saving never deletes a part its successor's snapshots name. The successor deletes the
    parts of the snapshot it read only once its predecessor has had its checks for a
    newer controller (``ADOPTED_GRACE_CHECKS``)."""
    from trainmover.control import saving

    run_dir, coordinator, in_store, in_files = _parts_job(tmp_path, server)
    old = coordinator()
    old._flush(force=True)
    read = set()
    S.read_newest(run_dir, old.ctx.store, KEY, read)
    assert read and {o for o, _ in read} == {old.saver.parts_of}
    new = coordinator()
    new.saver.saves = 1
    new.saver.adopt(read)
    new._flush(force=True)
    mine = set(new.saver.store_parts.present)
    assert new.saver.parts_of != old.saver.parts_of and mine
    assert S.read_newest(run_dir, new.ctx.store, KEY)[0] == 2
    before = old.saver.parts_of
    # the predecessor saves on for a moment, its tables changing: it deletes its own only
    for committed in range(3):
        m = old.ctx.membership.copy()
        m.workers["w0"], m.workers["w3"] = m.workers["w3"], m.workers["w0"]
        old.ctx.membership, old.ctx.committed = m, committed
        old._flush(force=True)
    assert in_store(new.saver.parts_of, mine) == mine == in_files(new.saver.parts_of, mine)
    left = {d for _, d in read} & old.saver.store_parts.present
    assert left
    new.ctx.committed = 5
    new._flush(force=True)                               # within the grace: kept
    assert in_store(before, left) == left == in_files(before, left)
    new.saver._adopted_until = 0.0                       # the grace is over
    new.ctx.committed = 6
    new._flush(force=True)
    assert in_store(before, left) == set() == in_files(before, left)
    assert S.read_newest(run_dir, new.ctx.store, KEY)[1]["ctx"]["committed"] == 6
    assert saving.ADOPTED_GRACE_CHECKS * new.cfg.controller.incarnation_check_s >= 2


def _parts_job(tmp_path, server):
    """A controller's saving parts, every table kept as parts, and where to look for them."""
    from trainmover.control.coordinator import Coordinator
    from trainmover.core.events import EventLog

    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir, mode=0o700)
    cfg = job()
    cfg.controller.snapshot_part_min_bytes = 0
    names = [f"w{i}" for i in range(4)]

    def coordinator():
        co = Coordinator(cfg, run_dir, quiet=True)
        co._run_key = KEY
        co.ctx.membership = C.Membership.initial(co.cfg.layout, names, ["s0"])
        co.ctx.store = AuthStore(client(server), KEY)
        co.ctx.events = EventLog(os.path.join(run_dir, "events.jsonl"), worker="coordinator")
        return co

    def in_store(owner, digests):
        return {d for d in digests if client(server).check([S.part_key(owner, d)])}

    def in_files(owner, digests):
        return {d for d in digests if os.path.exists(S.part_file(run_dir, owner, d))}
    return run_dir, coordinator, in_store, in_files


# --- real jobs ----------------------------------------------------------------------------------

def agent_pid(run_dir):
    from trainmover.core import jobfile

    return jobfile.read_control(run_dir)["agent_pid"]


def keep_writing(what, stop: threading.Event, every_s: float = 0.01):
    """``what()`` again and again until ``stop`` or the store is gone, in a thread of its
    own; the thread's ``done`` lists when each write was done."""
    def loop():
        while not stop.is_set():
            try:
                what()
            except Exception:  # noqa: BLE001 - the store went down with the job
                return
            thread.done.append(time.time())
            time.sleep(every_s)
    thread = threading.Thread(target=loop, daemon=True)
    thread.done = []
    thread.start()
    return thread


@pytest.mark.timeout(300)
def test_forged_beats_do_not_keep_a_frozen_worker_alive(tmp_path, baseline):
    """w2 is stopped (SIGSTOP) while someone keeps setting unsigned values at its heartbeat
    key and bumping it as a counter (which kept the old counter moving: the job stalled).
    It is found hung, fenced and replaced; the job ends on the uninterrupted run's weights."""
    from trainmover.api import Job
    from trainmover.control.client import connect

    run_dir = str(tmp_path / "run")
    job_ = Job(job(steps=STEPS), run_dir, timeout_s=150).start()
    wait_for(lambda: len(steps_done(run_dir)) >= 5, 120, "the first steps")
    (pid,) = [e["pid"] for e in events(run_dir, "process_started") if e["name"] == "w2"]
    raw = connect(run_dir).raw
    key = P.agent_key(0, "hb")              # the host's beat, w2's count in it
    count = iter(range(10**6, 10**9))
    stop = threading.Event()
    os.kill(pid, signal.SIGSTOP)
    # numbers (what the old reader's add(key, 0) saw move) and unsigned host beats that
    # leave w2 out of the quiet (as if it beat); at a pace that leaves the agent's genuine
    # beats readable between them (one that overwrote the key without pause would make
    # every process of the host look silent: docs/security.md)
    writer = keep_writing(lambda: (raw.set(key, str(next(count))), raw.add(key, 1), raw.set(
        key, P.write_message(P.HostBeat(next(count), 1, 4, {})))),
        stop, every_s=0.2)
    try:
        summary = job_.wait(200)
    finally:
        stop.set()
        writer.join()
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
    assert summary["weights_sha256"] == baseline and summary["steps"] == STEPS
    (rec,) = summary["recoveries"]
    assert rec["failures"] == {"w2": "hang"}, rec
    # found while the forged values kept coming, and they were refused
    (found,) = events(run_dir, "failure_detected")
    assert writer.done and writer.done[-1] > found["time"], (writer.done[-1:], found)
    assert any(e["key"] == key for e in events(run_dir, "message_rejected"))


@pytest.mark.timeout(300)
def test_junk_at_the_controllers_record_and_snapshot_stops_neither_it_nor_its_successor(
        tmp_path, baseline):
    """Junk at ``controller/current`` (who the controller is) once killed every controller
    the agent restarted, and the job was abandoned without a summary: now it reads as no
    record, and the running controller goes on. Then junk is written over the controller's
    snapshot in the store, and kept there, while the controller is killed: the restarted
    controller resumes from the run dir's copy (it used to exit on the junk, leaving the job
    without a controller until the agent gave it up), `trainmover status` reads that copy
    too meanwhile, and the job ends on the uninterrupted run's weights. (One job for both:
    the suite's time is mostly jobs starting.)"""
    from trainmover.control.client import connect
    from trainmover.control.status import read_status

    run_dir = str(tmp_path / "run")
    proc = start_controller(job(steps=STEPS), run_dir)
    try:
        wait_for(lambda: os.path.exists(os.path.join(run_dir, "control.json")) and
                 len(steps_done(run_dir)) >= 5, 120, "the first steps")
        store = connect(run_dir)
        store.raw.set(P.CONTROLLER_KEY, "junk")
        at = len(steps_done(run_dir))
        wait_for(lambda: len(steps_done(run_dir)) >= at + 10, 120, "steps after the junk")
        assert proc.poll() is None, proc.stdout.read().decode()[-2000:]   # it went on
        # a save that counts steps (the controller saves an idle state once a second: a
        # kill within a second of the job's start found only the save before its first step)
        wait_for(lambda: read_status(run_dir, store).committed_step >= 0, 30,
                 "a snapshot saved after the first steps")
        stop = threading.Event()
        writer = keep_writing(lambda: store.raw.set(P.CONTROLLER_SNAPSHOT_KEY, "junk"), stop,
                              0.002)
        try:
            time.sleep(0.3)
            proc.kill()
            proc.wait()
            st = read_status(run_dir, store)          # the dead controller's last save
            assert st.committed_step >= 0 and len(st.workers) == 4
            wait_for(lambda: events(run_dir, "controller_resumed") or
                     events(run_dir, "job_abandoned"), 120, "a restarted controller")
        finally:
            stop.set()
            writer.join()
        assert len(events(run_dir, "controller_resumed")) == 1, events(run_dir, "job_abandoned")
        summary = summary_of(run_dir)
        assert summary["weights_sha256"] == baseline and summary["steps"] == STEPS
        (passed,) = events(run_dir, "snapshot_passed_over")
        assert "the store's copy" in passed["copies"][0] and "not signed" in passed["copies"][0]
    finally:
        if proc.poll() is None:
            proc.kill()
        agent = agent_pid(run_dir) if os.path.exists(os.path.join(run_dir, "control.json")) \
            else None
        if agent is not None and pid_alive(agent) and not os.path.exists(
                os.path.join(run_dir, "summary.json")):
            os.kill(agent, signal.SIGKILL)            # the old code's orphaned job


@pytest.mark.timeout(300)
def test_forged_counts_neither_end_a_recovery_early_nor_make_it_abandon_its_plan(
        tmp_path, baseline):
    """w2 crashes while someone keeps adding to the counters of the coming recoveries and
    epochs: the recovered count (which ended a recovery once it reached the participants:
    its keys then went, a joiner's rendezvous among them) and the failure count (which made
    the controller abandon every plan it sent, as if a participant had failed). Both are
    hints now: the signed notes and reports decide. One recovery, no plan abandoned, done
    once its participants said so; the job ends on the uninterrupted run's weights."""
    from trainmover.api import Job
    from trainmover.control.client import connect

    run_dir = str(tmp_path / "run")
    # the standbys are frozen for a second across the crash: the joiner's note comes well
    # after the survivors' (under the heartbeat timeout: not found hung)
    job_ = Job(job(steps=STEPS, health_heartbeat_timeout_s=4.0, recovery_report_timeout_s=8.0),
               run_dir, timeout_s=150).start()
    wait_for(lambda: len(steps_done(run_dir)) >= 5, 120, "the first steps")
    pids = {e["name"]: e["pid"] for e in events(run_dir, "process_started")}
    raw = connect(run_dir).raw
    stop = threading.Event()

    def forge():
        for n in range(1, 4):
            raw.add(P.recovered_count_key(n), 100)
            raw.add(P.failure_count_key(n), 1)

    writer = keep_writing(forge, stop, every_s=0.05)
    wait_for(lambda: writer.done, 20, "the first forged counts")
    try:
        for name in ("s0", "s1"):
            os.kill(pids[name], signal.SIGSTOP)
        os.kill(pids["w2"], signal.SIGKILL)
        time.sleep(1.0)
    finally:
        for name in ("s0", "s1"):
            if pid_alive(pids[name]):
                os.kill(pids[name], signal.SIGCONT)
    try:
        summary = job_.wait(200)
    finally:
        stop.set()
        writer.join()
    assert summary["weights_sha256"] == baseline and summary["steps"] == STEPS
    (rec,) = summary["recoveries"]
    assert rec["failures"] == {"w2": "crash"} and rec["abandoned_plans"] == [], rec
    (done,) = events(run_dir, "recovery_resumed")
    notes = [e for e in events(run_dir) if e["event"] in ("recovered", "joiner_started")
             and e.get("recovery_id") == 1]
    assert len(notes) == 4 and all(e["time"] <= done["time"] for e in notes), (notes, done)
    assert done["participants"] == 4
    assert events(run_dir, "recovered_count_ahead")
    assert not events(run_dir, "recovery_abandoned")
