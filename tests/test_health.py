"""The controller's health checks on their own, against a fake job context (no processes)."""
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
    """Host 0's beat: each incarnation of the standby beat once, then fell silent (its count
    never moves again)."""

    def __init__(self, procs):
        self.raw, self.procs = self, procs

    def try_multi_get(self, keys):
        assert keys == [P.agent_key(0, "hb")]
        pid = self.procs.procs["s0"].pid
        return [P.write_message(P.HostBeat(pid, 7, {"s0": [pid, 1]})).encode()]

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


def fake_ctx():
    cfg = SimpleNamespace(health=SimpleNamespace(check_interval_s=0.0, heartbeat_timeout_s=5.0,
                                                 startup_timeout_s=30.0))
    procs = Procs()
    return SimpleNamespace(cfg=cfg, store=Store(procs), procs=procs, events=None,
                           membership=SimpleNamespace(standbys={"s0": C.StandbyState.RESERVED}))


def test_a_hung_standby_is_reported_once_per_incarnation(monkeypatch):
    """Fencing is carried out by the agent and the exit is seen later: until then the
    standby still looks alive and silent, and must not be reported (fenced, logged) again."""
    clock = Clock()
    monkeypatch.setattr(H, "time", clock)
    ctx = fake_ctx()
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
    quiet one fences the missing after the timeout, however many they are."""
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


def test_a_silence_wider_than_silence_max_hosts_waits_for_the_heartbeat_timeout(monkeypatch):
    """One agent silent while the others are heard is its host lost at the silence bound;
    three at once (more than ``silence_max_hosts``) are waited out to the heartbeat timeout,
    reported once as a wide silence, then declared lost if still silent."""
    clock = Clock()
    monkeypatch.setattr(H, "time", clock)
    events = []
    health_cfg = SimpleNamespace(heartbeat_timeout_s=3.0, startup_timeout_s=30.0,
                                 heartbeat_interval_s=0.25, silence_max_hosts=2,
                                 silence_s=lambda: 1.0)
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
