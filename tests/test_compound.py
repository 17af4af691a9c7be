"""Compound faults: a failure in the middle of a planned migration (of its leaver, a stayer,
at phase 1 or at the switch), a standby that died before it was needed. Each ends either
recovered, with the uninterrupted run's weights, or stopped cleanly; never hung."""
import os

import pytest

from trainmover.control.coordinator import JobFailed, run_job
from trainmover.core.events import read_jsonl
from trainmover.core.faults import Inject

from test_failures import baseline, job, with_faults  # noqa: F401 - baseline is a fixture


def run(tmp_path, cfg, *injects):
    run_dir = str(tmp_path / "run")
    summary = run_job(cfg, run_dir, quiet=True, timeout_s=300, injects=list(injects))
    return summary, read_jsonl(os.path.join(run_dir, "events.jsonl"))


# Tests that need a migration's switch to happen: the joiner's preparation takes a few tenths
# of a second, in which the tiny recipe runs ten or more steps, so a 16-step job could finish
# before the switch step (a run where it did: "the job finished before the switch step").
SWITCH_STEPS = 48


@pytest.fixture(scope="module")
def long_baseline(tmp_path_factory):
    root = tmp_path_factory.mktemp("long-baseline")
    return run_job(job(steps=SWITCH_STEPS), str(root / "run"), quiet=True,
                   timeout_s=300)["weights_sha256"]


def fired(events):
    return [(e["worker"], e["point"]) for e in events if e["event"] == "fault_injected"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("victim", ["w1", "w3"], ids=["leaver", "stayer"])
def test_failure_while_preparing_a_migration(tmp_path, long_baseline, victim):
    """w1 hands its role over; w1 itself (the leaver) or w3 (a stayer of w1's data-parallel
    group) crashes as it starts phase 1. The migration is abandoned (the live groups were
    never touched) and the crash is recovered like any other. Phase 1 starts once the
    joiner is warm: a 16-step job could end first on a loaded machine (a run where it did:
    the joiner warm after 0.96 s, "the job finished before the switch step")."""
    cfg = with_faults(job(steps=SWITCH_STEPS), Inject("crash", 6, victim, "prepare"))
    summary, events = run(tmp_path, cfg, Inject("migrate", 6, "w1"))
    assert fired(events) == [(victim, "prepare")]
    (mig,) = summary["migrations"]
    assert mig["status"] == "aborted" and "failure during the migration" in mig["reason"]
    (rec,) = summary["recoveries"]
    assert rec["failures"] == {victim: "crash"}
    assert summary["weights_sha256"] == long_baseline


@pytest.mark.timeout(300)
@pytest.mark.parametrize("victim", ["w1", "w3"], ids=["leaver", "stayer"])
def test_failure_at_the_switch_of_a_migration(tmp_path, long_baseline, victim):
    """The switch was ordered; w1 (the leaver, before sending its state) or w3 (a stayer,
    before installing the new groups) crashes at the switch boundary."""
    cfg = with_faults(job(steps=SWITCH_STEPS), Inject("crash", 6, victim, "switch"))
    summary, events = run(tmp_path, cfg, Inject("migrate", 6, "w1"))
    assert fired(events) == [(victim, "switch")]
    assert summary["weights_sha256"] == long_baseline
    assert summary["steps"] == SWITCH_STEPS
    (mig,) = summary["migrations"]
    (rec,) = summary["recoveries"]
    assert rec["failures"] == {victim: "crash"}
    if victim == "w1":
        # the leaver died before handing its state over: the migration is abandoned and
        # its role restored from its data-parallel replica
        assert mig["status"] == "aborted"
        assert rec["sources"] == {"dp0.pp1.tp0": "replica:w3"}
    elif mig["status"] == "interrupted":
        # the leaver had already handed over (the usual order): the joiner keeps the role
        # and is itself the replica the crashed stayer's role is restored from
        # (which standby joined depends on which was warm first: read it from the record)
        joiner = mig["pairs"][0]["joiner"]
        assert mig["committed_pairs"] == ["w1"]
        assert summary["membership"][joiner] == "dp0.pp1.tp0"
        assert rec["sources"] == {"dp1.pp1.tp0": f"replica:{joiner}"}
    else:   # the stayer's crash was seen before the leaver handed over
        assert mig["status"] == "aborted"


@pytest.mark.timeout(300)
def test_a_dead_standby_is_never_promoted(tmp_path, baseline):
    """The only standby dies while waiting; a later crash is recovered into a replacement
    process, not into the dead standby."""
    cfg = with_faults(job(standbys=1), Inject("crash", 1, "s0", "standby"),
                      Inject("crash", 8, "w2", "backward"))
    summary, events = run(tmp_path, cfg)
    assert [e["name"] for e in events if e["event"] == "standby_died"] == ["s0"]
    (rec,) = summary["recoveries"]
    assert rec["replacements"] == ["s1"] and rec["pairs"][0]["joiner"] == "s1"
    assert summary["weights_sha256"] == baseline


@pytest.mark.timeout(300)
def test_the_recovery_joiner_dies(tmp_path, baseline):
    """The standby promoted into a crashed worker's role dies while joining: the plan is
    abandoned (the survivors are woken out of their group builds), and a second plan uses
    the other standby. (Which standby is promoted first depends on which was warm first: the
    fault targets whichever it is.)"""
    cfg = with_faults(job(), Inject("crash", 5, "w2", "backward"),
                      Inject("crash", 5, "joiner", "joiner_prepare"))
    summary, events = run(tmp_path, cfg)
    (first, (dead, point)) = fired(events)
    assert first == ("w2", "backward") and point == "joiner_prepare" and dead in ("s0", "s1")
    (rec,) = summary["recoveries"]
    assert rec["abandoned_plans"] == [1]
    assert rec["pairs"][0]["joiner"] == {"s0": "s1", "s1": "s0"}[dead]
    assert summary["weights_sha256"] == baseline


@pytest.mark.timeout(300)
def test_a_recovery_given_up_too_often_stops_the_job_resumably(tmp_path):
    """A joiner that fails every time (here: once, with max_attempts=1) does not make the
    controller plan again for ever: the job stops, naming the setting and how to resume."""
    cfg = with_faults(job(recovery_max_attempts=1), Inject("crash", 5, "w2", "backward"),
                      Inject("crash", 5, "joiner", "joiner_prepare"))
    with pytest.raises(JobFailed, match=r"1 plan\(s\) in a row given up "
                                        r"\(recovery.max_attempts=1\).*--resume"):
        run(tmp_path, cfg)


@pytest.mark.timeout(300)
def test_a_survivor_dies_while_recovering(tmp_path, baseline):
    """A second worker crashes while carrying out the plan for the first: both roles are
    restored (each from its live data-parallel replica) under a new plan."""
    cfg = with_faults(job(), Inject("crash", 5, "w2", "backward"),
                      Inject("crash", 5, "w3", "recover"))
    summary, events = run(tmp_path, cfg)
    assert sorted(fired(events)) == [("w2", "backward"), ("w3", "recover")]
    (rec,) = summary["recoveries"]
    assert rec["failures"] == {"w2": "crash", "w3": "crash"}
    assert rec["sources"] == {"dp1.pp0.tp0": "replica:w0", "dp1.pp1.tp0": "replica:w1"}
    assert summary["weights_sha256"] == baseline


@pytest.mark.slow   # in `make test-slow`: a sibling in the default suite covers its mechanism
@pytest.mark.timeout(300)
def test_a_hung_joiner_aborts_its_migration_and_is_fenced(tmp_path):
    """The standby promoted by a planned migration stops (SIGSTOP) while preparing: its
    silence is detected within the heartbeat bound, it is fenced, the migration is aborted
    (the stayers drop the groups they were building) and training goes on, unharmed."""
    # long enough to outlast the detection (2 s of silence) by many steps
    base = run_job(job(steps=120), str(tmp_path / "base"), quiet=True, timeout_s=300)
    cfg = with_faults(job(steps=120), Inject("hang", 5, "joiner", "joiner_prepare"))
    summary, events = run(tmp_path, cfg, Inject("migrate", 5, "w1"))
    ((dead, point),) = fired(events)
    assert point == "joiner_prepare"
    (hung,) = [e for e in events if e["event"] == "standby_hung"]
    assert hung["name"] == dead and hung["state"] == "reserved"
    (mig,) = summary["migrations"]
    assert mig["status"] == "aborted" and dead in mig["reason"]
    assert summary["recoveries"] == [] and summary["membership"]["w1"] == "dp0.pp1.tp0"
    assert summary["weights_sha256"] == base["weights_sha256"]


@pytest.mark.slow   # in `make test-slow`: a sibling in the default suite covers its mechanism
@pytest.mark.timeout(300)
def test_a_hung_standby_is_fenced_and_the_pool_replenished(tmp_path, baseline):
    """A free standby stops while waiting: it is fenced and, with standby.replenish, a new
    standby takes its place in the pool, which a later crash is then recovered into."""
    cfg = with_faults(job(standbys=1, standby_replenish=True),
                      Inject("hang", 1, "s0", "standby"), Inject("crash", 9, "w2", "backward"))
    summary, events = run(tmp_path, cfg)
    (hung,) = [e for e in events if e["event"] == "standby_hung"]
    assert hung["name"] == "s0"
    assert [e["name"] for e in events if e["event"] == "standby_replenished"][:1] == ["s1"]
    (rec,) = summary["recoveries"]
    assert rec["pairs"][0]["joiner"] == "s1" and rec["replacements"] == []
    assert summary["weights_sha256"] == baseline


@pytest.mark.timeout(300)
# the assembler's case is the replica's (nothing recovered) plus its stand-in: replica slow
@pytest.mark.parametrize("victim", ["w0", pytest.param("w3", marks=pytest.mark.slow)],
                         ids=["assembler", "replica"])
def test_a_crash_after_the_last_commit_finishes_the_job(tmp_path, baseline, victim):
    """A worker dies after the job's last step was committed, before applying it: nothing
    is recovered (every role's state is final). If it held role dp0.pp0.tp0 (it writes its
    share of the final state and assembles the whole), its replica does that instead."""
    cfg = with_faults(job(), Inject("crash", 15, victim, "optimizer"))
    summary, events = run(tmp_path, cfg)
    assert fired(events) == [(victim, "optimizer")]
    (after,) = [e for e in events if e["event"] == "failure_after_last_step"]
    assert after["workers"] == [victim]
    assert summary["recoveries"] == [] and summary["steps"] == 16
    stand_ins = [e["worker"] for e in events if e["event"] == "final_shard_instead"]
    assert stand_ins == (["w2"] if victim == "w0" else [])
    assert summary["weights_sha256"] == baseline


@pytest.mark.timeout(300)
def test_a_crash_recovered_in_the_last_step_finishes_the_job_with_its_summary(tmp_path,
                                                                             baseline):
    """The end-of-job race: a worker dies inside the job's last step, before its vote. The
    step is aborted and recovered, redone, and the job ends right after the recovery:
    with its summary, the recovery accounted, and the uninterrupted run's weights."""
    cfg = with_faults(job(), Inject("crash", 15, "w1", "backward"))
    summary, events = run(tmp_path, cfg)
    assert fired(events) == [("w1", "backward")]
    (rec,) = summary["recoveries"]
    assert rec["status"] == "done" and rec["failures"] == {"w1": "crash"}, rec
    assert summary["steps"] == 16 and summary["weights_sha256"] == baseline


@pytest.mark.timeout(300)
def test_a_crash_after_the_last_commit_without_a_replica_stops_resumably(tmp_path):
    cfg = with_faults(job(dp=1, pp=2, standbys=1), Inject("crash", 15, "w0", "optimizer"))
    with pytest.raises(JobFailed, match="trainmover run --resume"):
        run(tmp_path, cfg)


@pytest.mark.timeout(300)
def test_a_joiner_that_dies_at_the_switch_is_recovered(tmp_path, long_baseline):
    """w1 hands its role to a standby; the joiner dies with the state in hand, before its
    first step (the leaver has left). The dead joiner held the role: the migration is
    settled with that pair committed, and the role is recovered from its replica."""
    cfg = with_faults(job(steps=SWITCH_STEPS), Inject("crash", 6, "joiner", "joiner_start"))
    summary, events = run(tmp_path, cfg, Inject("migrate", 6, "w1"))
    ((joiner, point),) = fired(events)
    assert point == "joiner_start"
    (mig,) = summary["migrations"]
    assert mig["status"] == "interrupted" and mig["committed_pairs"] == ["w1"]
    (rec,) = summary["recoveries"]
    assert rec["failures"] == {joiner: "crash"}
    assert rec["sources"] == {"dp0.pp1.tp0": "replica:w3"}
    assert summary["weights_sha256"] == long_baseline
