"""A downtime as people read it, from one rule (``core/accounting.py``): inside the step
noise it is "no measurable stall" with the noise beside it, never a (negative) number; the
places that print one (status of a running job, the demo's summary, ``bench quick``'s file,
``trainmover project``) use it. Torch-free and light: no job is run."""
import json
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainmover.core.accounting import (downtime_phrase, downtime_value, fmt_seconds,
                                        within_noise)

NEGATIVE = re.compile(r"(?<![\w±])-\d")     # a minus sign before a digit (not a range dash)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("downtime, noise, words", [
    (-0.004, 0.009, "no measurable stall (within step noise, ±9.0 ms)"),
    (0.009, 0.009, "no measurable stall (within step noise, ±9.0 ms)"),   # at the noise
    (0.0, None, "no measurable stall (within step noise)"),             # a clamped restart
    (0.0404, 0.0031, "40.4 ms (step noise ±3.1 ms)"),
    (2.26, None, "2.26 s"),
    (None, 0.01, "not measured"),
])
def test_downtime_value(downtime, noise, words):
    assert downtime_value(downtime, noise) == words
    assert within_noise(downtime, noise) == words.startswith("no measurable")
    # as a phrase of its own: the words where there is no stall, else "downtime ..."
    assert downtime_phrase(downtime, noise) == \
        (words if within_noise(downtime, noise) else f"downtime {words}")


@pytest.mark.timeout(60)
@given(st.floats(-10, 10, allow_nan=False), st.none() | st.floats(0, 1, allow_nan=False))
def test_no_negative_number_is_ever_shown(downtime, noise):
    text = downtime_phrase(downtime, noise)
    assert not NEGATIVE.search(text), text
    if noise is not None:       # the noise is always beside the figure
        assert f"±{fmt_seconds(noise)}" in text


MIGRATION = {"status": "done", "migration_id": 1, "switch_step": 9, "downtime_s": -0.004,
             "downtime_noise_s": 0.009, "pairs": [{"leaver": "w1", "joiner": "s0",
                                                   "role": "dp0.pp1.tp0"}],
             "phases": {"transfer_s": 0.01, "group_switch_s": 0.002, "prepare_s": 0.5,
                        "first_step_s": 0.2, "normal_train_step_s": 0.1},
             "transfer_bytes": 2e6, "groups_rebuilt": 3, "groups_total": 6}


@pytest.mark.timeout(30)
def test_a_running_jobs_status_words_its_newest_migration(tmp_path):
    from trainmover.control.status import render
    from trainmover.control.status_file import JobStatus

    st_ = JobStatus(committed_step=12, epoch=1, workers=[], standbys=[], controller_pid=None,
                    controller_alive=False, migration_in_flight=None, recovery_in_flight=None,
                    migrations=[MIGRATION])
    page = render(st_)
    assert "no measurable stall (within step noise, ±9.0 ms)" in page, page
    assert "-0.004" not in page


@pytest.mark.timeout(30)
def test_the_demos_summary_words_a_migration_inside_the_noise(tmp_path, capsys):
    from trainmover.core.config import JobConfig
    from trainmover.demo import print_demo_summary

    summary = {"steps": 30, "workers": 4, "standbys": 2, "final_loss": 3.2,
               "mean_step_time_s": 0.1, "weights_sha256": "ab" * 32,
               "migrations": [MIGRATION],
               "recoveries": [{"failures": {"w2": "crash"}, "pairs": [
                   {"joiner": "s1", "role": "dp1.pp0.tp0"}], "detection_latency_s": {
                   "w0": 0.5}, "downtime_s": 0.42, "resume_step": 20, "lost_steps": 0,
                   "sources": {"dp1.pp0.tp0": "replica:w0"}, "groups_rebuilt": 4,
                   "groups_total": 6}]}
    print_demo_summary(JobConfig(), str(tmp_path), summary)   # no events: no restart estimate
    out = capsys.readouterr().out
    assert "downtime          no measurable stall (within step noise, ±9.0 ms)" in out, out
    assert "downtime          420.0 ms (fault to first committed step" in out, out
    assert not NEGATIVE.search(out.split("weights sha256")[0]), out


def _rows():
    """A `bench quick` run's rows: the planned migration inside its noise, a crash recovery,
    a stop-and-restart, 3 repeats each."""
    rows = []
    for rep, (mig, crash, restart) in enumerate([(-0.004, 0.40, 8.0), (0.003, 0.42, 7.5),
                                                 (0.006, 0.45, 8.4)]):
        common = {"workers": 4, "repeat": rep, "compile": False, "layout": {}}
        rows += [
            {**common, "scenario": "planned", "strategy": "trainmover", "downtime_s": mig,
             "downtime_noise_s": 0.009, "normal_step_s": 0.1, "phases": {"transfer_s": 0.01}},
            {**common, "scenario": "crash", "strategy": "trainmover", "downtime_s": crash,
             "detection_latency_s": 0.2, "normal_step_s": 0.1, "phases": {
                 "detect_s": 0.2, "collect_s": 0.05, "rebuild_and_first_step_s": 0.15}},
            {**common, "scenario": "planned", "strategy": "restart", "downtime_s": restart,
             "normal_step_s": 0.1, "phases": {"restart_s": restart}}]
    return rows


@pytest.fixture
def quick_result(monkeypatch):
    from trainmover.bench import downtime

    monkeypatch.setattr(downtime, "machine_description", lambda: {
        "cpu": "test cpu", "cores": 2, "torch": "x"})
    monkeypatch.setattr(downtime, "git_commit", lambda: "abc1234")
    settings = {"event_step": 8, "repeats": 3, "compile": False, "compile_up_to": 8,
                "command": "trainmover bench quick --workers 4 --repeats 3"}
    return downtime.downtime_result(_rows(), settings, "/tmp/x", {})


@pytest.mark.timeout(30)
def test_quick_file_leads_with_the_three_headline_figures(quick_result):
    from trainmover.bench.quick import quick_table

    text = quick_table({**quick_result, "wall_s": 250.0})
    head, full = text.split("## The same runs in full", 1)
    assert "command: `trainmover bench quick --workers 4 --repeats 3`; commit abc1234" in head
    assert "took 4.2 min" in head
    (mig,) = [ln for ln in head.splitlines() if ln.startswith("| planned migration")]
    assert "| no measurable stall (within step noise, ±9.0 ms) |" in mig, mig
    (crash,) = [ln for ln in head.splitlines() if ln.startswith("| crash recovered")]
    assert "| 420.0 ms (400.0 ms to 450.0 ms) | 200.0 ms | 3 (0) |" in crash, crash
    (restart,) = [ln for ln in head.splitlines() if ln.startswith("| stop and restart")]
    assert "| 8.00 s (7.50 s to 8.40 s) |" in restart, restart
    assert "restart is at least 889x that noise" in head     # 8.0 s over 9 ms
    assert not NEGATIVE.search(head), head
    # the full table words the cell inside the noise too, instead of its (negative) median
    (row,) = [ln for ln in full.splitlines() if ln.startswith("| planned | 4 | no | trainm")]
    assert "no measurable stall (within step noise, ±9.0 ms)" in row and "-0.004" not in row


@pytest.mark.timeout(30)
def test_project_reads_a_quick_file(quick_result, tmp_path, capsys):
    from trainmover.bench.project import costs_from_bench
    from trainmover.cli import main

    path = tmp_path / "quick.json"
    path.write_text(json.dumps(quick_result))
    costs = costs_from_bench([str(path)])
    # no naive migration in it: the whole job's restart stands in for a cold join
    assert costs.cold_join_s == 8.0 and costs.source["cold_join_from"] == "planned restart"
    assert costs.restart_here_s == 8.0
    # the migration's median (3 ms) is inside its 9 ms noise: the noise is its cost
    assert costs.planned_s == 0.009 and costs.planned_measured_s == 0.003
    assert main(["project", "--bench", str(path), "--out", str(tmp_path), "--name", "pq"]) == 0
    table = (tmp_path / "pq.md").read_text()
    assert "planned migration no measurable stall (within step noise, ±9.0 ms; counted as " \
           "9.0 ms, an upper bound)" in table
    assert "the planned restart of the whole job stands in" in table
    # a file without a crash recovery cannot feed it, and says what is missing
    only_planned = {**quick_result, "results": [r for r in quick_result["results"]
                                                if r["scenario"] == "planned"]}
    path.write_text(json.dumps(only_planned))
    with pytest.raises(ValueError, match="no crash result for trainmover"):
        costs_from_bench([str(path)])


@pytest.mark.timeout(30)
def test_a_cell_without_such_a_run_is_refused_before_anything_runs():
    from trainmover.bench.downtime import bench_downtime

    with pytest.raises(ValueError, match="no 'crash' scenario for strategy 'naive'"):
        bench_downtime([4], cells=[("crash", "naive")])
