"""Stop and resume: a graceful stop (``trainmover stop``, SIGTERM of ``trainmover run``)
checkpoints a few steps ahead and ends every process of the job; ``--resume`` continues from
that checkpoint and ends bit-identical to a run that never stopped."""
import json
import os
import signal
import subprocess
import sys
import threading

import pytest

from trainmover.api import Job
from trainmover.cli import build_config, parse_command_line
from trainmover.control.client import connect, request_stop
from trainmover.control.coordinator import run_job
from trainmover.core import identity, jobfile
from trainmover.core import protocol as P
from trainmover.core.auth import create_secret
from trainmover.core.events import read_jsonl
from trainmover.core.files import check_checkpoint, complete_steps
from trainmover.core.proc import pid_alive

from mp_harness import wait_for
from test_failures import job

STEPS = 30


def committed(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    return max((r["step"] for r in read_jsonl(path)), default=-1) if os.path.exists(path) else -1


def agent_pid(run_dir):
    with open(os.path.join(run_dir, "control.json")) as f:
        return json.load(f)["agent_pid"]


def started_pids(run_dir):
    return [e["pid"] for e in read_jsonl(os.path.join(run_dir, "events.jsonl"))
            if e["event"] == "process_started"]


@pytest.fixture(scope="module")
def baseline(reference_weights):
    """The uninterrupted run's weights (both stop tests run this job: one reference)."""
    return reference_weights(job(steps=STEPS, standbys=1))


@pytest.mark.timeout(400)
def test_trainmover_stop_then_resume_is_bit_identical(tmp_path, baseline):
    run_dir = str(tmp_path / "run")
    running = Job(job(steps=STEPS, standbys=1), run_dir, timeout_s=300).start()
    wait_for(lambda: committed(run_dir) >= 8, 200, "step 8")
    answer = {}
    asker = threading.Thread(target=lambda: answer.update(request_stop(run_dir, "test")))
    asker.start()
    # what anyone on the network sees of the order: its signed value, kept to replay later
    raw = connect(run_dir).raw
    wait_for(lambda: raw.check([P.STOP_REQUEST_KEY]), 60, "the stop request")
    captured = raw.get(P.STOP_REQUEST_KEY)
    stopped = running.wait(200)
    asker.join(60)
    assert stopped["stopped"] and stopped["reason"] == "test"
    step = stopped["resume_step"]
    # the order takes effect a few steps ahead of the step it was seen at
    assert 9 < step < STEPS
    assert complete_steps(run_dir)[-1] == step and check_checkpoint(run_dir, step) is None
    assert committed(run_dir) == step - 1            # nothing past the stop was committed
    assert answer["status"] == "stopped" and answer["resume_step"] == step
    assert not pid_alive(agent_pid(run_dir))
    assert not [p for p in started_pids(run_dir) if pid_alive(p)]
    events = read_jsonl(os.path.join(run_dir, "events.jsonl"))
    assert sorted(e["worker"] for e in events if e["event"] == "worker_stopped") == \
        ["w0", "w1", "w2", "w3"]

    resumed_job = Job.resume(run_dir, timeout_s=300).start()
    # the first run's stop request replayed into the resumed run: signed with another run's
    # key, refused (it once stopped every resume again)
    wait_for(lambda: committed(run_dir) >= step + 2, 200, "the resumed run's first steps")
    connect(run_dir).raw.set(P.STOP_REQUEST_KEY, captured)
    resumed = resumed_job.wait(320)
    assert resumed["steps"] == STEPS and not resumed.get("stopped")
    assert resumed["weights_sha256"] == baseline
    events = read_jsonl(os.path.join(run_dir, "events.jsonl"))
    (start,) = [e for e in events if e["event"] == "job_started" and e["resumed_from"]]
    assert start["resumed_from"] == step
    loaded = [e["step"] for e in events if e["event"] == "checkpoint_loaded"]
    assert loaded == [step] * 4
    (replayed,) = [e for e in events if e["event"] == "message_rejected"]
    assert replayed["key"] == P.STOP_REQUEST_KEY and "bad signature" in replayed["error"]


def cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "trainmover", *args], capture_output=True,
                          text=True, timeout=kw.pop("timeout", 300), **kw)


# the job of `baseline` (test_failures.job: one intra-op thread per worker), as flags
CLI_JOB = ["--recipe", "tiny", "--dp", "2", "--pp", "2", "--tp", "1", "--steps", str(STEPS),
           "--train.threads_per_worker=1", "--standbys", "1", "--checkpoint-every", "4",
           "--quiet"]


@pytest.mark.timeout(500)
def test_sigterm_stops_trainmover_run_gracefully_and_run_resume_continues(tmp_path,
                                                                          reference_weights):
    """SIGTERM to `trainmover run` (what a scheduler or a closed terminal sends): a graceful
    stop, exit code 0, nothing left running; `trainmover run --resume` ends with the weights
    of the same job run without stopping."""
    base_sha = reference_weights(build_config(parse_command_line(["run", *CLI_JOB])))
    run_dir = str(tmp_path / "run")
    proc = subprocess.Popen([sys.executable, "-m", "trainmover", "run", *CLI_JOB,
                             "--run-dir", run_dir], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: committed(run_dir) >= 6, 200, "step 6")
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "SIGTERM: stopping gracefully" in err
    summary = json.loads(out)
    assert summary["stopped"] and summary["reason"] == "SIGTERM"
    assert not pid_alive(agent_pid(run_dir))
    assert not [p for p in started_pids(run_dir) if pid_alive(p)]

    bad = cli("run", "--resume", run_dir, "--steps", "40")
    assert bad.returncode == 2 and "drop --steps" in bad.stderr
    done = cli("run", "--resume", run_dir, "--quiet")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["weights_sha256"] == base_sha
    again = cli("run", "--resume", run_dir)
    assert again.returncode == 2 and "already finished" in again.stderr


def test_resume_refuses_a_run_dir_without_a_job_or_a_checkpoint(tmp_path):
    empty = cli("run", "--resume", str(tmp_path))
    assert empty.returncode == 2 and "no job there" in empty.stderr
    run_dir = tmp_path / "run"
    (run_dir / "ckpt" / "step4").mkdir(parents=True)
    os.chmod(run_dir, 0o700)
    cfg = job(steps=STEPS)
    secret = create_secret(str(run_dir))     # as the job's controller left it
    jobfile.write_job(str(run_dir), cfg, secret)
    identity.write_identity(str(run_dir), identity.of_job(cfg.to_dict(), cfg.process.command),
                            secret)
    (run_dir / "ckpt" / "step4" / "COMPLETE").write_text("4\n")   # no manifest
    none = cli("run", "--resume", str(run_dir))
    assert none.returncode == 2 and "no complete checkpoint" in none.stderr
    assert "step 4: no readable manifest" in none.stderr


@pytest.mark.timeout(300)
def test_status_of_a_finished_job_reports_its_outcome(tmp_path):
    """A finished job's status is its summary (as `kubectl get job` or `sacct` give a
    finished job's), at once: no store to reach any more."""
    run_dir = str(tmp_path / "run")
    summary = run_job(job(steps=4, standbys=0), run_dir, quiet=True, timeout_s=200)
    res = subprocess.run([sys.executable, "-m", "trainmover", "status", "--run-dir", run_dir],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "finished: 4 steps" in res.stdout and summary["weights_sha256"] in res.stdout
    assert f"{run_dir}/summary.json" in res.stdout
    res = subprocess.run([sys.executable, "-m", "trainmover", "status", "--run-dir", run_dir,
                          "--json"], capture_output=True, text=True, timeout=60)
    out = json.loads(res.stdout)
    assert out["state"] == "finished" and out["summary"]["steps"] == 4
