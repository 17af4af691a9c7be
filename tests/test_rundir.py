"""The run dir cannot be planted or swapped by another local user (core/rundir.py): a run dir
or a folder above it that someone else owns or can write, a symlink in place of the run dir
or of a file in it, and job files altered behind the controller's back are all refused before
anything they name runs. The attacks run as a second, unprivileged user the test creates."""
import json
import os
import shutil
import subprocess
import sys
import uuid

import pytest

from trainmover.core import identity, jobfile, rundir
from trainmover.core.auth import create_secret
from trainmover.core.config import JobConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _job(tmp_path):
    """A run dir as the controller leaves it: secret, sealed job.json and identity.json."""
    run_dir = str(tmp_path / "run")
    rundir.create(run_dir)
    secret = create_secret(run_dir)
    cfg = JobConfig()
    jobfile.write_job(run_dir, cfg, secret)
    identity.write_identity(run_dir, identity.of_job(cfg.to_dict(), cfg.process.command), secret)
    return run_dir, secret


def test_a_new_run_dir_is_made_private_and_its_job_files_read_back(tmp_path):
    run_dir, secret = _job(tmp_path)
    assert os.stat(run_dir).st_mode & 0o777 == 0o700
    assert jobfile.read_job(run_dir).to_dict() == JobConfig().to_dict()
    assert identity.read_identity(run_dir, secret).config_sha256


def test_an_altered_job_json_is_refused_before_its_command_is_read(tmp_path):
    run_dir, _ = _job(tmp_path)
    path = os.path.join(run_dir, "job.json")
    data = json.loads(open(path).read())
    data["process"]["command"] = ["python", "/tmp/evil.py"]
    with open(path, "w") as f:
        json.dump(data, f)
    with pytest.raises(rundir.UnsafeRunDir, match="does not match its MAC"):
        jobfile.read_job(run_dir)


def test_a_job_file_without_its_mac_or_a_missing_identity_is_refused(tmp_path):
    run_dir, secret = _job(tmp_path)
    os.remove(os.path.join(run_dir, "identity.json"))
    with pytest.raises(identity.IdentityMismatch, match="missing"):
        identity.read_identity(run_dir, secret)
    os.remove(os.path.join(run_dir, "job.json.mac"))
    with pytest.raises(rundir.UnsafeRunDir, match="no .mac beside it"):
        jobfile.read_job(run_dir)


def test_a_symlink_in_place_of_the_run_dir_or_a_file_in_it_is_refused(tmp_path):
    run_dir, _ = _job(tmp_path)
    link = str(tmp_path / "link")
    os.symlink(run_dir, link)
    with pytest.raises(rundir.UnsafeRunDir, match="is a symlink"):
        rundir.check_dir(link)
    with pytest.raises(rundir.UnsafeRunDir, match="is a symlink"):
        rundir.create(link)
    other = tmp_path / "elsewhere.json"
    other.write_text("{}")
    events = os.path.join(run_dir, "events.jsonl")
    os.symlink(other, events)
    with pytest.raises(rundir.UnsafeRunDir, match="is a symlink"):
        rundir.open_file(events, os.O_WRONLY | os.O_APPEND)
    assert other.read_text() == "{}"


def test_a_run_dir_or_a_folder_above_writable_by_others_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)                      # no sticky bit: anyone may rename entries
    with pytest.raises(rundir.UnsafeRunDir, match="writable by other users"):
        rundir.create(str(shared / "run"))
    os.chmod(shared, 0o1777)                     # as /tmp: allowed
    rundir.create(str(shared / "run"))
    mine = tmp_path / "mine"
    mine.mkdir()
    os.chmod(mine, 0o770)
    with pytest.raises(rundir.UnsafeRunDir, match="mode 770"):
        rundir.create(str(mine))


# --- a second local user plants run dirs ------------------------------------------------------

@pytest.fixture(scope="module")
def attacker():
    """A second, unprivileged local user (created here, removed after)."""
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        pytest.skip("needs root and useradd to create a second user")
    name = f"tmatk{uuid.uuid4().hex[:6]}"
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                   check=True, capture_output=True)
    try:
        yield name
    finally:
        subprocess.run(["userdel", name], capture_output=True)


def _as(user, *cmd):
    subprocess.run(list(cmd), user=user, check=True, capture_output=True, timeout=30)


def _launch(run_dir):
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-m", "trainmover", "launch", "--nproc", "2",
                           "--run-dir", run_dir, "--", "python",
                           os.path.join(ROOT, "examples", "ddp_gpt.py"), "--steps", "1"],
                          capture_output=True, text=True, timeout=120, env=env)


@pytest.fixture
def planted(attacker):
    """A fresh path in /tmp (root's, sticky) for the attacker to plant things at."""
    paths = []

    def make(kind):
        path = f"/tmp/tm-planted-{uuid.uuid4().hex[:8]}"
        paths.append(path)
        if kind == "dir":
            # the attack: a run dir made in advance, with a job.json naming the
            # attacker's command, a marker showing whether anything of it ran
            _as(attacker, "mkdir", "-m", "0777", path)
            _as(attacker, "sh", "-c", f"echo '{{}}' > {path}/job.json")
        elif kind == "symlink":
            target = f"{path}-target"
            paths.append(target)
            _as(attacker, "mkdir", "-m", "0777", target)
            _as(attacker, "ln", "-s", target, path)
        elif kind == "parent":
            _as(attacker, "mkdir", "-m", "0755", path)
            path = os.path.join(path, "run")
        return path

    yield make
    for p in paths:
        subprocess.run(["rm", "-rf", p])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind, why", [
    ("dir", "belongs to another user"),
    ("symlink", "is a symlink"),
    ("parent", "above it belongs to another user"),
])
def test_a_run_dir_planted_by_another_user_is_refused_before_anything_starts(
        planted, kind, why):
    path = planted(kind)
    res = _launch(path)
    assert res.returncode == 2, res.stderr[-2000:]
    assert why in res.stderr and path.split("/run")[0] in res.stderr, res.stderr[-2000:]
    # nothing of the job was written there: no secret, no logs, no file of root's
    real = os.path.realpath(path)
    if os.path.isdir(real):
        owner = os.stat(real).st_uid
        assert owner != 0
        assert all(os.stat(os.path.join(real, n)).st_uid == owner for n in os.listdir(real))
        assert "secret" not in os.listdir(real)


def test_an_ended_job_is_shown_with_the_event_that_ended_it(tmp_path):
    """Workers still exiting after the controller gave up log their own errors later: the
    status of the ended job names the job_failed event, not the newest worker error."""
    from trainmover.control.status import ended, render_ended
    run_dir, secret = _job(tmp_path)
    jobfile.write_control(run_dir, {"store": "127.0.0.1:1", "agent_pid": 2 ** 22 + 1},
                          secret)                                    # no such process
    jobfile.start_run(run_dir, secret)
    with open(os.path.join(run_dir, "events.jsonl"), "w") as f:
        for event, error in (("script_error", "ModuleNotFoundError: w0"),
                             ("job_failed", "JobFailed: the script failed before init"),
                             ("script_error", "ModuleNotFoundError: w2")):
            f.write(json.dumps({"event": event, "level": "error", "error": error}) + "\n")
    outcome = ended(run_dir, fresh_s=0.0)
    assert outcome["state"] == "failed" and outcome["ended_by"]["event"] == "job_failed"
    assert "ended by job_failed: JobFailed" in render_ended(run_dir, outcome)
    # without a job_failed event, the newest error
    with open(os.path.join(run_dir, "events.jsonl"), "w") as f:
        f.write(json.dumps({"event": "worker_crash", "level": "error", "error": "x"}) + "\n")
    assert ended(run_dir, fresh_s=0.0)["ended_by"]["event"] == "worker_crash"


REWRITER = """
import sys, time
from trainmover.core import rundir
run_dir, secret = sys.argv[1], bytes.fromhex(sys.argv[2])
versions = [('{"version": %d, "pad": "%s"}' % (i, "x" * (i % 7))).encode() for i in range(50)]
i = 0
while True:                  # a rewrite every 5 ms: each opens a window of microseconds
    i += 1
    rundir.write_sealed(run_dir, "sealed.json", versions[i % len(versions)], secret)
    time.sleep(0.005)
"""


@pytest.mark.timeout(60)
def test_a_sealed_file_read_while_it_is_rewritten_is_read_whole(tmp_path):
    """The controller rewrites identity.json (the data's digest) while standbys start and
    read it: a reader between the MAC's rename and the file's must not take the pair for a
    forgery (it refused a standby's start under load), and only pairs that check are used."""
    run_dir, secret = _job(tmp_path)
    versions = {('{"version": %d, "pad": "%s"}' % (i, "x" * (i % 7))).encode()
                for i in range(50)}
    rundir.write_sealed(run_dir, "sealed.json", sorted(versions)[0], secret)
    writer = subprocess.Popen([sys.executable, "-c", REWRITER, run_dir, secret.hex()])
    try:
        seen = {rundir.read_sealed(run_dir, "sealed.json", secret) for _ in range(5000)}
    finally:
        writer.kill()
        writer.wait()
    assert seen <= versions and len(seen) > 1
