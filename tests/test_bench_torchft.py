"""The torchft side-by-side benchmark's arithmetic on synthetic step logs, and its refusal
without torchft (the run itself needs torchft and minutes: `trainmover bench torchft`)."""
import pytest

from trainmover.bench import torchft_side as T
from trainmover.cli import main


def log(replica, step, t, participants, committed=True):
    return {"replica": replica, "step": step, "t": t, "participants": participants,
            "committed": committed}


def test_stall_full_width_and_skipped_samples():
    rows = []
    # three replicas start together; replica 2 joins one step late (not the failure's doing)
    rows += [log(r, 0, 0.1, 2) for r in (0, 1)]
    for s in range(1, 10):
        rows += [log(r, s, 0.1 + 0.1 * s, 3) for r in (0, 1, 2)]
    t_kill = 1.05
    # replica 1 dies; the step in flight is discarded, survivors stall 0.6 s, then 4 steps
    # at width 2, then full width again when the relaunched replica has healed
    rows += [log(r, 10, 1.2, 3, committed=False) for r in (0, 2)]
    t = 1.0 + 0.1 + 0.6
    for s in range(10, 14):
        rows += [log(r, s, t, 2) for r in (0, 2)]
        t += 0.1
    rows += [log(r, 14, 2.3, 3) for r in (0, 1, 2)]
    got = T.summarize_torchft(rows, 3, victim=1, t_kill=t_kill, per_replica=8)
    assert got["normal_step_s"] == pytest.approx(0.1)
    assert got["survivor_stall_s"] == pytest.approx(0.6)          # 1.7 - 1.0 - 0.1
    assert got["kill_to_full_width_s"] == pytest.approx(2.3 - 1.05)
    assert got["steps_below_full_width"] == 4
    assert got["samples_skipped"] == 4 * 8                          # one shard of 8, 4 steps
    assert got["steps_discarded"] == 1


def test_full_width_comes_after_the_last_step_below_it():
    # the step in flight when replica 1 died commits at full width just after the kill (its
    # all-reduce was done); then two steps at width 2; full width again at t = 2.0
    rows = [log(r, s, 0.1 * s, 3) for s in range(1, 10) for r in (0, 1, 2)]
    t_kill = 0.95
    rows += [log(r, 10, 1.0, 3) for r in (0, 2)]
    rows += [log(r, s, t, 2) for s, t in ((11, 1.1), (12, 1.2)) for r in (0, 2)]
    rows += [log(r, 13, 2.0, 3) for r in (0, 1, 2)]
    got = T.summarize_torchft(rows, 3, victim=1, t_kill=t_kill, per_replica=8)
    assert got["kill_to_full_width_s"] == pytest.approx(2.0 - 0.95)
    assert got["samples_skipped"] == 2 * 8


def test_without_torchft_the_benchmark_says_so(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(T, "torchft_version", lambda: None)
    assert main(["bench", "torchft", "--out", str(tmp_path)]) == 2
    assert "needs torchft" in capsys.readouterr().err


def test_a_layout_the_recipe_cannot_split_is_refused_before_launch(capsys, tmp_path):
    if T.torchft_version() is None:
        pytest.skip("torchft is not installed: the version check refuses first")
    assert main(["bench", "torchft", "--replicas", "3", "--recipe", "demo",
                 "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--replicas 3" in err and "not divisible" in err
