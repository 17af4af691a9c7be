"""How long the agent's loop sleeps (``agent/main.py``, ``Agent._idle_for``): until its next
timer, ``agent.idle_wake_s`` at most, ``agent.poll_s`` at least, and ``poll_s`` while a
process's exit cannot wake it. It used to wake every ``poll_s`` whatever was due."""
from types import SimpleNamespace

import pytest

from trainmover.agent.main import Agent
from trainmover.core.config import JobConfig


def agent(node: int = 1, etcd: bool = False, next_check: float = 0.1) -> Agent:
    a = Agent.__new__(Agent)            # its loop's state only: no store, no run dir
    a.cfg = JobConfig()
    a.cfg.agent.poll_s, a.cfg.agent.idle_wake_s = 0.02, 1.0
    a.node, a.etcd = node, etcd
    a.children = {}
    a._subreaper, a._reap_at = False, 0.0
    a.controller = SimpleNamespace(next_check_in=lambda now: next_check)
    return a


def child(kill_at=None, wakes=True, reported=False):
    return SimpleNamespace(kill_at=kill_at, reported=reported, exit_wakes=lambda: wakes)


def test_the_agents_loop_sleeps_until_its_next_timer():
    now = 100.0
    a = agent()
    assert a._idle_for(now) == pytest.approx(1.0)           # nothing due
    a.children = {"w0": child(), "w1": child(kill_at=now + 0.3)}
    assert a._idle_for(now) == pytest.approx(0.3)           # a TERM's KILL deadline
    a.children["w1"] = child(kill_at=now - 5)
    assert a._idle_for(now) == pytest.approx(0.02)          # past due: the shortest sleep
    a.children["w1"] = child(kill_at=now - 5, reported=True)
    assert a._idle_for(now) == pytest.approx(1.0)           # gone: nothing to keep
    a.children["w2"] = child(wakes=False)
    assert a._idle_for(now) == pytest.approx(0.02)          # its exit must be polled
    a.children.pop("w2")
    a._subreaper, a._reap_at = True, now + 0.5
    assert a._idle_for(now) == pytest.approx(0.5)           # the orphans' reaping
    # host 0's agent checks the controller's process; with etcd every agent may
    assert agent(node=0, next_check=0.1)._idle_for(now) == pytest.approx(0.1)
    assert agent(node=3, etcd=True, next_check=0.4)._idle_for(now) == pytest.approx(0.4)
    assert agent(node=3, next_check=0.1)._idle_for(now) == pytest.approx(1.0)
