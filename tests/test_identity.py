"""Data and code identity: a process that would train on other tokens, another script or
another configuration than the job's is refused, with both digests in the message."""
import hashlib
import json
import os

import pytest

from trainmover.api import Job
from trainmover.control.coordinator import JobFailed, resumable
from trainmover.core import identity, jobfile
from trainmover.core.auth import create_secret
from trainmover.core.faults import Inject

from mp_harness import wait_for
from test_failures import job, with_faults
from test_stop_resume import committed


def test_a_changed_script_is_named_with_both_digests(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('v1')\n")
    cfg = {"name": "x", "process": {"command": [str(script)]}}
    job_id = identity.of_job(cfg, [str(script)])
    assert job_id.script_sha256 == hashlib.sha256(b"print('v1')\n").hexdigest()
    identity.compare(job_id, identity.of_job(cfg, [str(script)]), "w0")   # unchanged: fine
    script.write_text("print('v2')\n")
    mine = identity.of_job(cfg, [str(script)])
    with pytest.raises(identity.IdentityMismatch) as err:
        identity.compare(job_id, mine, "w0")
    assert job_id.script_sha256 in str(err.value) and mine.script_sha256 in str(err.value)
    assert "training script" in str(err.value)
    with pytest.raises(identity.IdentityMismatch, match="configuration"):
        identity.compare(job_id, identity.of_job({**cfg, "name": "y"}, [str(script)]), "w0")


def test_resume_refuses_a_job_whose_script_changed(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "ckpt").mkdir(parents=True)
    os.chmod(run_dir, 0o700)
    secret = create_secret(str(run_dir))
    script = tmp_path / "train.py"
    script.write_text("print('v1')\n")
    cfg = job()
    cfg.process.command = [str(script)]
    jobfile.write_job(str(run_dir), cfg, secret)
    identity.write_identity(str(run_dir), identity.of_job(cfg.to_dict(), [str(script)]), secret)
    script.write_text("print('v2')\n")
    with pytest.raises(identity.IdentityMismatch, match="training script has sha256"):
        resumable(str(run_dir))


@pytest.mark.timeout(300)
def test_a_replacement_that_loads_changed_data_is_refused(tmp_path):
    """The data file changes while the job runs; the replacement process started for a
    crashed worker loads the new bytes and must refuse, naming both digests, instead of
    training the role on other tokens."""
    data = tmp_path / "corpus.txt"
    text = ("the quick brown fox jumps over the lazy dog. " * 2000).encode()
    data.write_bytes(text)
    cfg = with_faults(job(standbys=0, steps=40, data_source=str(data)),
                      Inject("crash", 8, "w2", "forward"))
    run_dir = str(tmp_path / "run")
    running = Job(cfg, run_dir, timeout_s=250).start()
    wait_for(lambda: committed(run_dir) >= 2, 200, "step 2")
    data.write_bytes(text + b"appended later")
    with pytest.raises(JobFailed) as err:
        running.wait(260)
    old, new = hashlib.sha256(text).hexdigest(), \
        hashlib.sha256(text + b"appended later").hexdigest()
    # refused as a standby, or (promoted at once, as a replacement for a failed role is) as
    # the role's new holder: either way for the data, naming both digests
    assert "the data changed since the job started" in str(err.value)
    assert old in str(err.value) and new in str(err.value)
    with open(os.path.join(run_dir, "identity.json")) as f:
        assert json.load(f)["data_sha256"] == old
