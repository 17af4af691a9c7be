"""`trainmover status` of a job that is not running any more answers at once from its run
dir (no store to reach, no torch): finished, stopped and failed, in words and with --json.
The run dirs are built from the files a real run leaves (``job.json``, ``control.json`` and
``run.json`` sealed as the controller writes them, ``summary.json`` as ``Coordinator._finish``
and ``_stopped`` write it, ``events.jsonl``, ``metrics.jsonl``, a stale ``status.json``):
no job is run."""
import json
import os
import subprocess
import sys
import time

import pytest

from trainmover.cli import main
from trainmover.control.status import ended
from trainmover.core import jobfile, rundir
from trainmover.core.auth import create_secret
from trainmover.core.config import JobConfig

DEAD_PID = 2 ** 22 + 1          # above the kernel's pid_max default: no such process
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_dir(tmp_path, agent_pid=DEAD_PID, control=True) -> str:
    """A run dir as a launch leaves it; the store's address is one nobody serves."""
    run_dir = str(tmp_path / "run")
    rundir.create(run_dir)
    secret = create_secret(run_dir)
    jobfile.write_job(run_dir, JobConfig(name="toy"), secret)
    if control:
        jobfile.write_control(run_dir, {"store": "127.0.0.1:1", "agent_pid": agent_pid},
                              secret)
    jobfile.start_run(run_dir, secret)
    # the controller's last status.json, long stale, its writer gone
    with open(os.path.join(run_dir, "status.json"), "w") as f:
        json.dump({"committed_step": 5, "epoch": 0, "workers": [], "standbys": [],
                   "controller_pid": DEAD_PID, "controller_alive": True,
                   "migration_in_flight": None, "recovery_in_flight": None,
                   "as_of": time.time() - 3600, "source": "controller"}, f)
    return run_dir


def _write(run_dir, name, records) -> None:
    with open(os.path.join(run_dir, name), "w") as f:
        if name.endswith(".jsonl"):
            f.writelines(json.dumps(r) + "\n" for r in records)
        else:
            json.dump(records, f)


def _metrics(run_dir, steps: int) -> None:
    _write(run_dir, "metrics.jsonl", [{"time": 1000.0 + s, "step": s, "loss": 5.0 - s / 10,
                                       "step_time_s": 0.1} for s in range(steps)])


MIGRATION = {"status": "done", "migration_id": 1, "switch_step": 3, "downtime_s": -0.004,
             "downtime_noise_s": 0.009, "pairs": [{"leaver": "w1", "joiner": "s0"}]}
RECOVERY = {"status": "done", "recovery_id": 1, "resume_step": 5, "downtime_s": 0.42,
            "lost_steps": 1, "failures": {"w2": "crash"}}


def _status(run_dir, capsys, *flags) -> str:
    assert main(["status", "--run-dir", run_dir, *flags]) == 0
    return capsys.readouterr().out


@pytest.mark.timeout(60)
def test_a_finished_job_shows_its_steps_loss_interruptions_and_summary(tmp_path, capsys):
    run_dir = _run_dir(tmp_path)
    _metrics(run_dir, 8)
    _write(run_dir, "summary.json", {
        "name": "toy", "steps": 8, "final_loss": 4.3, "layout": {"dp": 2, "pp": 1, "tp": 1},
        "workers": 2, "standbys": 1, "weights_sha256": "ab" * 32, "replicas_agree": True,
        "checkpoint": f"{run_dir}/final/checkpoint", "wall_s": 12.5,
        "mean_step_time_s": 0.1, "migrations": [MIGRATION], "recoveries": [RECOVERY],
        "stragglers": []})
    page = _status(run_dir, capsys)
    assert "job 'toy' finished: 8 steps, final loss 4.3000" in page, page
    # the migration inside the step noise says so, never "-4.0 ms"; the recovery's figure
    assert "migrations: 1 done of 1, downtime no measurable stall (within step noise, " \
           "±9.0 ms)\n" in page, page
    assert "recoveries: 1 done of 1, 1 committed steps lost, downtime 420.0 ms\n" in page, page
    assert "-4.0" not in page and "-0.004" not in page
    assert f"summary: {run_dir}/summary.json" in page
    out = json.loads(_status(run_dir, capsys, "--json"))
    assert (out["state"], out["steps"], out["final_loss"]) == ("finished", 8, 4.3)
    assert out["summary_path"] == f"{run_dir}/summary.json" and out["ended_by"] is None
    assert out["migrations"] == {"done": 1, "total": 1, "lost_steps": 0, "downtimes": [
        "no measurable stall (within step noise, ±9.0 ms)"]}
    assert out["recoveries"]["done"] == 1 and out["recoveries"]["lost_steps"] == 1


@pytest.mark.timeout(60)
def test_a_stopped_job_shows_where_it_resumes_and_its_last_loss(tmp_path, capsys):
    run_dir = _run_dir(tmp_path)
    _metrics(run_dir, 6)
    # as Coordinator._stopped writes it: no final loss there, the metrics have it
    _write(run_dir, "summary.json", {
        "name": "toy", "stopped": True, "reason": "maintenance", "resume_step": 6,
        "checkpoint": f"{run_dir}/ckpt/step6", "steps": 6, "wall_s": 9.0,
        "layout": {"dp": 2, "pp": 1, "tp": 1}, "migrations": [], "restarts": [],
        "recoveries": [RECOVERY]})
    page = _status(run_dir, capsys)
    assert "job 'toy' stopped at step 6, final loss 4.5000 (maintenance)" in page, page
    assert f"trainmover run --resume {run_dir}" in page
    assert "migrations: 0 done of 0\nrecoveries: 1 done of 1" in page
    assert f"summary: {run_dir}/summary.json" in page
    out = json.loads(_status(run_dir, capsys, "--json"))
    assert (out["state"], out["steps"], out["final_loss"]) == ("stopped", 6, 4.5)
    assert out["summary_path"] == f"{run_dir}/summary.json"


def _failed_events(run_dir) -> None:
    _write(run_dir, "events.jsonl", [
        # the run before a --resume: its migration is not this run's
        {"time": 1.0, "event": "job_started"},
        {"time": 2.0, "event": "migration_done", **MIGRATION, "migration_id": 7},
        {"time": 3.0, "event": "job_started"},
        {"time": 4.0, "event": "migration_done", **MIGRATION, "downtime_s": 0.05},
        {"time": 5.0, "event": "worker_crash", "level": "error", "error": "w2 exited -9"},
        {"time": 6.0, "event": "job_failed", "level": "error",
         "error": "JobFailed: cannot recover from ['w2']"},
        # a worker still exiting logs its own error later: not what ended the job
        {"time": 7.0, "event": "script_error", "level": "error", "error": "w3: broken pipe"}])


@pytest.mark.timeout(60)
def test_a_failed_job_names_the_event_that_ended_it_at_once_without_torch(tmp_path):
    run_dir = _run_dir(tmp_path)
    _metrics(run_dir, 7)
    _failed_events(run_dir)
    # a fresh interpreter: the answer must not wait on the store's address (nobody serves
    # it: a client would wait out its 10 s connect timeout) nor import torch
    probe = ("import json, sys, time; from trainmover.cli import main; t = time.time(); "
             f"rc = main(['status', '--run-dir', {run_dir!r}] + sys.argv[1:]); "
             "print(json.dumps({'rc': rc, 'torch': 'torch' in sys.modules, "
             "'s': time.time() - t}))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    for flags in ([], ["--json"]):
        res = subprocess.run([sys.executable, "-c", probe, *flags], capture_output=True,
                             text=True, timeout=50, env=env)
        *shown, verdict = res.stdout.strip().splitlines()
        verdict = json.loads(verdict)
        assert verdict["rc"] == 0 and not verdict["torch"], res.stderr
        assert verdict["s"] < 5.0, verdict
        shown = "\n".join(shown)
        if flags:
            out = json.loads(shown)
            assert (out["state"], out["steps"], out["final_loss"]) == ("failed", 7, 4.4)
            assert out["ended_by"]["event"] == "job_failed" and out["summary_path"] is None
            assert out["migrations"] == {"done": 1, "total": 1, "lost_steps": 0,
                                         "downtimes": ["50.0 ms (step noise ±9.0 ms)"]}
        else:
            assert "job 'toy' failed after 7 committed steps, final loss 4.4000; ended by " \
                   "job_failed: JobFailed: cannot recover from ['w2']" in shown, shown
            assert "is not running and left no summary" in shown


@pytest.mark.timeout(60)
def test_which_run_dirs_count_as_ended(tmp_path):
    # a summary is trusted even where the agent's PID is alive (after the job, that PID may
    # be another process's): this test's own PID stands for such a recycled one
    run_dir = _run_dir(tmp_path / "a", agent_pid=os.getpid())
    _write(run_dir, "summary.json", {"name": "toy", "steps": 3, "final_loss": 1.0})
    assert ended(run_dir, fresh_s=3.0)["state"] == "finished"
    # no summary and the agent alive: running
    os.remove(os.path.join(run_dir, "summary.json"))
    assert ended(run_dir, fresh_s=3.0) is None
    # failed before its agent started (no control.json): the job_failed event says so
    run_dir = _run_dir(tmp_path / "b", control=False)
    assert ended(run_dir, fresh_s=3.0) is None      # nothing ran, nothing failed: starting
    _failed_events(run_dir)
    outcome = ended(run_dir, fresh_s=3.0)
    assert outcome["state"] == "failed" and outcome["steps"] == 0
    assert outcome["ended_by"]["event"] == "job_failed"
