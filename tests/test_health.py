"""The controller's health checks on their own, against a fake job context (no processes)."""
import dataclasses
from types import SimpleNamespace

from trainmover.control import health as H
from trainmover.core import decisions as C
from trainmover.core import protocol as P


class Clock:
    def __init__(self):
        self.now = 1000.0

    def time(self):
        return self.now

    def monotonic(self):
        return self.now


class Store:
    """Host 0's beat, as its agent writes it: each incarnation of the standby beat once,
    when first seen, then fell silent (listed as quiet, for longer at each beat)."""

    def __init__(self, procs, clock):
        self.raw, self.procs, self.clock = self, procs, clock
        self.seq = 0
        self.beat_at = {}                        # pid -> when it beat

    def try_multi_get(self, keys):
        assert keys == [P.agent_key(0, "hb")]
        pid = self.procs.procs["s0"].pid
        silent_ms = int((self.clock.now - self.beat_at.setdefault(pid, self.clock.now)) * 1000)
        self.seq += 1
        quiet = {"s0": [pid, silent_ms]} if silent_ms > 375 else {}
        return [P.write_message(P.HostBeat(self.seq, 7, 1, quiet)).encode()]

    def genuine(self, key, raw):
        return raw


class Procs:
    def __init__(self):
        self.procs = {"s0": SimpleNamespace(node=0, incarnation=1, code=None, pid=41)}
        self.lost = []
        self.nnodes = 1

    def known(self, name):
        return name in self.procs

    def running(self, name):
        return self.procs[name].code is None

    def pid(self, name):
        return self.procs[name].pid

    def learn_pids(self, names):
        pass                                     # known from the start


def fake_ctx(clock):
    from trainmover.core.config import HealthConfig

    cfg = SimpleNamespace(health=HealthConfig(check_interval_s=0.0, heartbeat_timeout_s=5.0,
                                              startup_timeout_s=30.0))
    procs = Procs()
    return SimpleNamespace(cfg=cfg, store=Store(procs, clock), procs=procs, events=None,
                           membership=SimpleNamespace(standbys={"s0": C.StandbyState.RESERVED}))


def test_a_hung_standby_is_reported_once_per_incarnation(monkeypatch):
    """Fencing is carried out by the agent and the exit is seen later: until then the
    standby still looks alive and silent, and must not be reported (fenced, logged) again."""
    clock = Clock()
    monkeypatch.setattr(H, "time", clock)
    ctx = fake_ctx(clock)
    health = H.Health(ctx)
    assert health.hung_standbys() == []          # its beat is first seen now
    clock.now += 4.0
    assert health.hung_standbys() == []          # quiet, within the timeout
    clock.now += 2.0
    ((name, why),) = health.hung_standbys()
    assert name == "s0" and "no heartbeat for 6.00 s" in why
    clock.now += 1.0
    assert health.hung_standbys() == []          # killed, its exit not seen yet
    # a new incarnation under the same name is a new process, watched afresh
    ctx.procs.procs["s0"] = SimpleNamespace(node=0, incarnation=2, code=None, pid=42)
    assert health.hung_standbys() == []
    clock.now += 6.0
    assert [n for n, _ in health.hung_standbys()] == ["s0"]


def test_survivors_silent_after_an_abort_are_fenced_only_once_reports_stop_coming():
    """A slow control plane (reports still arriving) fences nobody until the bound; a
    quiet one names the missing after the timeout, however many they are (whether the job
    can take their loss is ``fence_silent_later``'s)."""
    from trainmover.core.decisions import silent_survivors

    missing = [f"w{i}" for i in (10, 2, 1)]
    # reports kept coming (the last 1 s ago) for 30 s: nobody is fenced, majority or not
    assert silent_survivors(missing, waited_s=30.0, quiet_s=1.0, timeout_s=6.0,
                            max_wait_s=120.0) == []
    # nothing new for longer than the timeout: the missing are hung, in natural order
    assert silent_survivors(missing, waited_s=30.0, quiet_s=6.5, timeout_s=6.0,
                            max_wait_s=120.0) == ["w1", "w2", "w10"]
    # a fixed bound, however reports keep coming
    assert silent_survivors(missing, waited_s=121.0, quiet_s=0.1, timeout_s=6.0,
                            max_wait_s=120.0) == ["w1", "w2", "w10"]
    assert silent_survivors([], waited_s=500.0, quiet_s=500.0, timeout_s=6.0,
                            max_wait_s=120.0) == []



def test_a_survivor_with_an_agent_is_fenced_on_its_agents_word_or_after_twice_the_timeout():
    """A survivor whose host's agent named it silent (timed on the host) is fenced however
    recently a report came; one whose agent said nothing is given twice the timeout (its
    host's writes may lag the others'); one without an agent keeps the plain timeout."""
    from trainmover.core.decisions import silent_survivors

    missing = ["w3", "w56", "w7"]
    hosted = {"w3", "w56"}
    # w3 named silent by its agent: fenced at once; w56 (agent, no word) and w7 (no
    # agent) not yet, reports came 1 s ago
    assert silent_survivors(missing, 8.0, 1.0, 6.0, 120.0, {"w3"}, hosted) == ["w3"]
    # 7 s without a new report: w7 (no agent) is hung; w56's agent may still be writing
    assert silent_survivors(missing, 20.0, 7.0, 6.0, 120.0, set(), hosted) == ["w7"]
    # past twice the timeout without a word: w3 and w56 too
    assert silent_survivors(missing, 20.0, 12.5, 6.0, 120.0, set(), hosted) == \
        ["w3", "w7", "w56"]
    assert silent_survivors(missing, 121.0, 0.0, 6.0, 120.0, set(), hosted) == \
        ["w3", "w7", "w56"]


def test_a_silence_wider_than_silence_max_hosts_waits_for_the_heartbeat_timeout(monkeypatch):
    """One agent silent while the others are heard is its host lost at the silence bound;
    three at once (more than ``silence_max_hosts``) are waited out to the heartbeat timeout,
    reported once as a wide silence, then declared lost if still silent."""
    clock = Clock()
    monkeypatch.setattr(H, "time", clock)
    events = []
    from trainmover.core.config import HealthConfig

    health_cfg = HealthConfig(heartbeat_timeout_s=3.0, startup_timeout_s=30.0,
                              heartbeat_interval_s=0.25, silence_max_hosts=2)
    assert health_cfg.silence_s(6) == 1.0 and health_cfg.timeout_s(6) == 3.0
    ctx = SimpleNamespace(
        cfg=SimpleNamespace(health=health_cfg, process=SimpleNamespace(etcd=False)),
        procs=SimpleNamespace(lost=set(), nnodes=6),
        events=SimpleNamespace(emit=lambda event, **kw: events.append((event, kw))))
    health = H.Health(ctx)
    monkeypatch.setattr(health, "read_hosts", lambda now: None)
    declared = []
    monkeypatch.setattr(health, "_declare_lost", lambda node, why: declared.append((node, why)))

    def beats(quiet: dict[int, float]) -> None:
        for node in range(1, 6):
            health._host_beats[node] = ((100 + node, 1), clock.now - quiet.get(node, 0.1))

    beats({1: 1.5})
    assert health._check_hosts(clock.now, set(), set()) == {1}
    assert "while other hosts are heard" in declared[0][1] and events == []
    declared.clear()
    beats({1: 1.5, 2: 1.6, 3: 1.7})
    assert health._check_hosts(clock.now, set(), set()) == set() and declared == []
    assert health._check_hosts(clock.now, set(), set()) == set()
    assert [e for e, _ in events] == ["wide_silence"]            # once while it lasts
    assert events[0][1]["hosts"] == 3 and events[0][1]["whose"] == "agents"
    beats({1: 3.5, 2: 3.6, 3: 3.7})
    assert health._check_hosts(clock.now, set(), set()) == {1, 2, 3}
    assert all("heartbeat stopped" in why for _, why in declared)


class Hosts:
    """Signed-store stand-in that the detector reads: each host's beat as its agent writes it
    (``P.HostBeat``), finished and report keys absent."""

    def __init__(self):
        self.raw = self
        self.beats = {}
        self.seq = 0
        self.adds = {}

    def beat(self, node, running, quiet=None, perf=0, pid=None):
        self.seq += 1
        self.beats[P.agent_key(node, "hb")] = P.write_message(
            P.HostBeat(self.seq, pid or 500 + node, running, quiet or {}, perf)).encode()

    def try_multi_get(self, keys):
        return [self.beats.get(k) for k in keys]

    def genuine(self, key, raw):
        return raw

    def valid_many(self, keys):
        return [None for _ in keys]

    def add(self, key, amount):
        self.adds[key] = self.adds.get(key, 0) + amount
        return self.adds[key]

    def set(self, key, value):
        self.beats[key] = value

    def delete_key(self, key):
        return self.beats.pop(key, None) is not None


def test_hosts_beat_less_often_past_the_stores_budget_and_the_rules_wait_as_many_beats():
    """Each agent writes its host's beat every heartbeat interval up to
    ``host_beats_per_s`` beats a second for the job, every hosts / host_beats_per_s seconds
    beyond; the silence and the timeout the controller applies count that many beats."""
    from trainmover.core.config import HealthConfig

    h = HealthConfig()
    for hosts in (1, 8, 1000):                  # the defaults, as before, to 8,000 GPUs
        assert (h.host_beat_interval_s(hosts), h.silence_s(hosts), h.timeout_s(hosts)) == \
            (0.25, 1.0, 3.0)
    assert (h.host_beat_interval_s(2048), h.silence_s(2048), h.timeout_s(2048)) == \
        (0.512, 2.048, 4.096)
    # 100K GPUs: 12,500 hosts' beats stay at 4,000 a second, every 3.1 s each
    assert (h.host_beat_interval_s(12_500), h.silence_s(12_500), h.timeout_s(12_500)) == \
        (3.125, 12.5, 25.0)
    assert 12_500 / h.host_beat_interval_s(12_500) == h.host_beats_per_s
    # a silence floor raised by the user leaves the timeout as set below 1,000 hosts
    assert HealthConfig(silence_floor_s=5.0).timeout_s(512) == 3.0
    h.validate()
    HealthConfig(host_beats_per_s=2500.5).validate()
    for bad in (0, -1.0, "many"):
        try:
            HealthConfig(host_beats_per_s=bad).validate()
        except ValueError as exc:
            assert f"health.host_beats_per_s must be > 0, got {bad!r}" in str(exc)
        else:
            raise AssertionError(f"host_beats_per_s={bad!r} accepted")


def test_a_large_jobs_hosts_beating_seconds_apart_are_heard_and_a_silent_one_is_lost(
        monkeypatch):
    """With the hosts' beats 2 s apart (the store's budget for them reached), no host and no
    worker is silent between two beats; a host that stops beating while the others are
    heard is lost after its silence of four of those beats, not one second."""
    clock = Clock()
    monkeypatch.setattr(H, "time", clock)
    health, ctx, store = detector(clock, nodes=8)
    ctx.cfg.health.host_beats_per_s = 4.0                  # 8 hosts: a beat every 2 s
    assert ctx.cfg.health.silence_s(8) == 8.0
    for _ in range(10):                                     # 19 s of beats 1.9 s apart
        clock.now += 1.9
        for node in range(8):
            store.beat(node, 2)
        assert health.detect(set()) == [] and not ctx.procs.lost
    for _ in range(4):                                      # host 5 falls silent: 7.6 s
        clock.now += 1.9
        for node in range(8):
            if node != 5:
                store.beat(node, 2)
        assert health.detect(set()) == [] and not ctx.procs.lost
    clock.now += 1.9                                        # 9.5 s > 8 s
    for node in range(8):
        if node != 5:
            store.beat(node, 2)
    found = health.detect(set())
    assert set(ctx.procs.lost) == {5} and {f.worker for f in found} == {"w10", "w11"}
    assert all(f.kind == "host" for f in found)


def test_the_hosts_keys_are_read_less_often_as_their_beats_come_less_often(monkeypatch):
    """A look reads every host's key: at every check interval (0.05 s) while the hosts beat
    every heartbeat interval (0.25 s), every 0.4 s when their beats come 2 s apart (the
    store's budget for them reached: 12,500 hosts' reads at every check were 250,000 keys a
    second)."""
    clock = Clock()
    monkeypatch.setattr(H, "time", clock)

    def reads(beats_per_s: float) -> int:
        health, ctx, store = detector(clock, nodes=8)
        ctx.cfg.health.host_beats_per_s = beats_per_s
        ctx.cfg.health.check_interval_s = 0.05
        count = [0]
        inner = store.try_multi_get

        def counted(keys):
            count[0] += any(k.endswith("/hb") for k in keys)
            return inner(keys)

        store.try_multi_get = counted
        for _ in range(80):                               # 4 s, a look every 0.051 s
            clock.now += 0.051
            health.detect(set())
        return count[0]

    assert reads(4000.0) == 80                            # 8 hosts: beats every 0.25 s
    assert 9 <= reads(4.0) <= 11                          # every 2 s: a look every 0.4 s


def detector(clock, nodes=3, per_node=2):
    """A controller's detector over ``nodes`` hosts of ``per_node`` workers each, every
    worker started (its PID known), every host heard once with all of its workers beating."""
    from trainmover.control.processes import AgentClient, ProcView
    from trainmover.core.config import HealthConfig

    store = Hosts()
    procs = AgentClient(store=store, nnodes=nodes)
    names = [f"w{i}" for i in range(nodes * per_node)]
    for i, name in enumerate(names):
        procs.procs[name] = ProcView(False, 1, i // per_node, pid=100 + i)
    events = []
    ctx = SimpleNamespace(
        cfg=SimpleNamespace(health=HealthConfig(), process=SimpleNamespace(etcd="")),
        store=store, procs=procs, epoch=0, steady_since=0.0, cmd_next={},
        membership=SimpleNamespace(workers=dict.fromkeys(names), standbys={}),
        # a step committed since the start: the heartbeat timeout applies, not the start-up's
        progress=SimpleNamespace(records=[{"time": clock.now}], say=lambda text: None),
        events=SimpleNamespace(emit=lambda event, **kw: events.append((event, kw))))
    for node in range(nodes):
        store.beat(node, per_node)
    health = H.Health(ctx)
    assert health.detect(set()) == []
    return health, ctx, store


def test_a_worker_its_host_lists_as_quiet_is_hung_after_the_timeout(monkeypatch):
    """The controller judges the processes a host's beat lists as quiet, with how long their
    agent has not heard them: w3 silent past the heartbeat timeout is hung, its neighbour
    and the other hosts' workers (not listed) are not; a former incarnation listed under the
    name is not the current one's silence."""
    clock = Clock()
    monkeypatch.setattr(H, "time", clock)
    health, ctx, store = detector(clock)
    timeout = ctx.cfg.health.heartbeat_timeout_s

    def later(w3):
        """A second later, every host beats; host 1 lists w3 as ``w3`` says."""
        clock.now += 1.0
        for node in (0, 2):
            store.beat(node, 2)
        store.beat(1, 2, {"w3": w3})

    later([103, 2000])
    assert health.detect(set()) == []                      # silent 2 s: within the timeout
    assert health._beat("w3") == clock.now - 2.0 and health._beat("w2") == clock.now
    later([103, int((timeout + 0.5) * 1000)])
    (f,) = health.detect(set())
    assert (f.worker, f.kind) == ("w3", "hang") and "no heartbeat for 3.50 s" in f.detail
    assert health.detect({"w3"}) == []                     # handled: not found again
    later([999, 60_000])                                   # another PID: a former process
    assert health._beat("w3") is None and health.detect(set()) == []
    later([103, -1])                                       # listed before its first beat
    assert health._beat("w3") is None and health.detect(set()) == []


def test_crashes_come_from_the_failed_index_and_a_respawn_clears_it(monkeypatch):
    """Exits are found from the process table's index of failed processes, every round;
    a new incarnation of the name is not failed; an index lost with a resume is rebuilt."""
    clock = Clock()
    monkeypatch.setattr(H, "time", clock)
    health, ctx, store = detector(clock)
    ctx.procs.procs["w4"] = dataclasses.replace(ctx.procs.procs["w4"], code=7)   # its exit
    ctx.procs.failed().add("w4")
    clock.now += 0.01                                      # a round, no look due
    (f,) = health.detect(set())
    assert (f.worker, f.kind, f.detail) == ("w4", "crash", "exit code 7")
    ctx.procs.mark_lost(2)                                 # w4 and w5's host
    assert sorted((f.worker, f.kind) for f in health.detect(set())) == [
        ("w4", "host"), ("w5", "host")]
    ctx.procs.spawn_request("w4", standby=False, node=1)
    assert "w4" not in ctx.procs.failed()
    ctx.procs.failed_index = None                          # as a resumed controller has it
    assert ctx.procs.failed() == {"w5"}


def test_host_0_silent_has_its_workers_judged_one_by_one(monkeypatch):
    """Host 0 serves the built-in store, so no host rule judges it: when its agent falls
    silent its workers are judged as silent themselves (a scan only while that lasts); a
    silent other host is judged by the host rules instead, as lost, and the command messages
    its agent did not read are deleted."""
    clock = Clock()
    monkeypatch.setattr(H, "time", clock)
    health, ctx, store = detector(clock)
    # host 1's agent read and deleted its command messages 1-3, not 4-6 (then it died)
    ctx.cmd_next["1"] = 7
    for number in (4, 5, 6):
        store.set(P.host_command_key(1, number), "commands")
    store.set(P.host_command_key(0, 2), "host 0's")
    timeout = ctx.cfg.health.heartbeat_timeout_s
    for _ in range(int(timeout / 0.25) + 2):
        clock.now += 0.25
        store.beat(1, 2)
        store.beat(2, 2)
        found = health.detect(set())
    assert sorted((f.worker, f.kind) for f in found) == [("w0", "hang"), ("w1", "hang")]
    clock.now += 0.25
    store.beat(0, 2)
    store.beat(2, 2)
    for _ in range(int(timeout / 0.25) + 2):
        clock.now += 0.25
        store.beat(0, 2)
        store.beat(2, 2)
        found = health.detect({"w0", "w1"})
        if found:
            break
    assert sorted((f.worker, f.kind) for f in found) == [("w2", "host"), ("w3", "host")]
    assert ctx.procs.lost == [1]
    # fenced, and its unread command messages gone with it (another host's left alone)
    assert store.beats[P.agent_key(1, "fenced")].startswith("its agent")
    assert [k for k in store.beats if "/cmd/" in k] == [P.host_command_key(0, 2)]


def test_an_agents_beat_lists_only_the_processes_it_has_not_heard_lately():
    """The agent's side: a process that beat within ``quiet_listed_s`` is left out, one
    silent longer is listed with how long, one that never beat with -1, one that exited is
    neither listed nor counted as running."""
    from trainmover.agent.beat import HostBeat
    from trainmover.core.config import HealthConfig

    after = HealthConfig().quiet_listed_s()
    assert after == 1.5 * HealthConfig().heartbeat_interval_s

    def child(name, pid, beats, beat_at, code=None):
        return SimpleNamespace(name=name, beats=beats, beat_at=beat_at,
                               proc=SimpleNamespace(pid=pid, returncode=code))

    beat = HostBeat.__new__(HostBeat)        # its summary alone: no thread, no store
    beat.quiet_after_s = after
    beat.children = lambda: [child("w0", 10, 5, 99.9), child("w1", 11, 5, 98.0),
                             child("w2", 12, 0, 0.0), child("w3", 13, 5, 10.0, code=1)]
    assert beat.summary(100.0) == ({"w0", "w1", "w2"}, {"w1": [11, 2000], "w2": [12, -1]})


def test_the_hosts_whose_beats_announce_new_measurements_are_handed_to_the_straggler_feed(
        monkeypatch):
    """``perf_moved``: the hosts whose beat's ``HostPerf`` seq changed since the last call
    (a restarted agent's seq 1 again is a change; a beat that repeats it is not), each once."""
    clock = Clock()
    monkeypatch.setattr(H, "time", clock)
    health, ctx, store = detector(clock)
    assert health.perf_moved() == set()            # none announced yet

    def look(perfs: dict[int, int], pid=None):
        clock.now += 0.25
        for node in range(3):
            store.beat(node, 2, perf=perfs.get(node, 0), pid=pid if node == 2 else None)
        health.read_hosts(clock.now)

    look({0: 1, 2: 1})
    assert health.perf_moved() == {0, 2}
    assert health.perf_moved() == set()            # handed over once
    look({0: 1, 2: 1})
    assert health.perf_moved() == set()            # the same values again: nothing new
    look({0: 2, 2: 1})
    look({0: 3, 2: 1})
    assert health.perf_moved() == {0}              # two moves between calls: once
    look({0: 3, 2: 1}, pid=777)                    # host 2's agent restarted: seq 1 anew
    assert health.perf_moved() == {2}


def test_without_replica_agrees_with_replica_of_for_random_failures():
    """The counting answer equals asking ``replica_of`` for every failed role."""
    import random

    from trainmover.core.decisions import Membership, replica_of, without_replica
    from trainmover.core.topology import Layout

    rng = random.Random(7)
    for _ in range(300):
        layout = Layout(dp=rng.choice([1, 2, 3, 4]), pp=rng.choice([1, 2]),
                        tp=rng.choice([1, 2]))
        workers = [f"w{i}" for i in range(layout.num_roles)]
        m = Membership.initial(layout, workers, [])
        failed = set(rng.sample(workers, rng.randint(0, len(workers))))
        want = any(replica_of(m, m.workers[w], failed) is None for w in failed)
        assert without_replica(m, failed) == want, (layout, sorted(failed))


def test_silent_survivors_are_fenced_now_only_if_the_job_can_lose_them():
    """Fenced at once when no more than the free standbys (at least one) and replicas
    remain for every role, or a snapshot or checkpoint can stand in (asked only then); else
    not before the bound, however long they are silent."""
    from trainmover.core.decisions import Membership, fence_silent_later
    from trainmover.core.topology import Layout

    m = Membership.initial(Layout(dp=2, pp=1, tp=2), ["w0", "w1", "w2", "w3"], ["s0"])
    asked = []

    def copy(answer):
        return lambda: asked.append(answer) or answer

    # w0 failed, w1 silent: dp0.pp0.tp0 and dp0.pp0.tp1 keep replicas w2, w3
    assert fence_silent_later(m, {"w0"}, ["w1"], 10.0, 120.0, copy(False)) is None
    assert asked == []
    # w0 failed, w2 (its only replica) silent: no copy -> wait; a copy -> fence
    assert "no copy" in fence_silent_later(m, {"w0"}, ["w2"], 10.0, 120.0, copy(False))
    assert fence_silent_later(m, {"w0"}, ["w2"], 10.0, 120.0, copy(True)) is None
    # past the bound, whatever is left
    assert fence_silent_later(m, {"w0"}, ["w1", "w2", "w3"], 121.0, 120.0, copy(False)) is None
    assert asked == [False, True]
    # more silent than free standbys: a restart's worth, not hung workers: the bound,
    # replicas and copies or not
    wide = Membership.initial(Layout(dp=4, pp=1, tp=1), ["w0", "w1", "w2", "w3"], ["s0"])
    assert "free standbys (1)" in fence_silent_later(wide, {"w0"}, ["w1", "w2"], 10.0, 120.0,
                                                     copy(True))
    assert fence_silent_later(wide, {"w0"}, ["w1"], 10.0, 120.0, copy(True)) is None
    assert fence_silent_later(wide, {"w0"}, ["w1", "w2"], 121.0, 120.0, copy(True)) is None
    assert asked == [False, True]
