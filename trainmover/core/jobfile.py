"""The job's files in its run dir that say what runs: ``job.json`` (the configuration, the
command included) and ``control.json`` (where the store is, the agent's PID), each read only
from a run dir that passes ``rundir.check_dir`` and only once its MAC under the job's secret
checks (``core/rundir.py``)."""
from __future__ import annotations

import hashlib
import hmac
import json
import secrets

from trainmover.core import rundir
from trainmover.core.auth import load_secret
from trainmover.core.config import JobConfig

JOB_FILE = "job.json"
CONTROL_FILE = "control.json"


def write_job(run_dir: str, cfg: JobConfig, secret: bytes) -> None:
    rundir.write_sealed(run_dir, JOB_FILE, json.dumps(cfg.to_dict(), indent=2).encode(),
                        secret)


def read_job(run_dir: str, secret: bytes | None = None) -> JobConfig:
    """The job's configuration; raises ``UnsafeRunDir`` (a ValueError) naming the problem."""
    rundir.check_dir(run_dir)
    secret = load_secret(run_dir) if secret is None else secret
    return JobConfig.from_dict(rundir.read_sealed_json(run_dir, JOB_FILE, secret))


def write_control(run_dir: str, control: dict, secret: bytes) -> None:
    rundir.write_sealed(run_dir, CONTROL_FILE, json.dumps(control).encode(), secret)


def read_control(run_dir: str, secret: bytes | None = None) -> dict:
    rundir.check_dir(run_dir)
    secret = load_secret(run_dir) if secret is None else secret
    control = rundir.read_sealed_json(run_dir, CONTROL_FILE, secret)
    if not isinstance(control, dict) or not isinstance(control.get("store"), str):
        raise rundir.UnsafeRunDir(f"{run_dir}/{CONTROL_FILE}: not a job's control record")
    return control


# --- the run's own key -----------------------------------------------------------------------
# Each launch and each --resume of a job is a new *run*: ``run.json`` (sealed) holds a fresh
# random run id, and every value in the store and every snapshot frame is signed with a key
# derived from the job's secret and that id. A value captured in one run (a stop request, a
# command) is refused in every other, although the secret stays the job's.
RUN_FILE = "run.json"


def derive_run_key(secret: bytes, run_id: str) -> bytes:
    return hmac.new(secret, b"run:" + run_id.encode(), hashlib.sha256).hexdigest().encode()


def python_hash_seed(secret: bytes) -> str:
    """The job's ``PYTHONHASHSEED``, the same in all its processes and across its resumes
    (derived from the secret, from which it reveals nothing): a script that seeds with
    Python's salted ``hash()`` of a string gets the same numbers in a joiner, a replacement
    and a resumed run as in the process it replaces. 1 .. 2**32-1 (0 would turn hash
    randomization off)."""
    digest = hmac.new(secret, b"python-hash-seed", hashlib.sha256).digest()
    return str(int.from_bytes(digest[:4], "big") % (2**32 - 1) + 1)


def start_run(run_dir: str, secret: bytes) -> bytes:
    """A new run of the job (written before any of its processes starts): its key."""
    run_id = secrets.token_hex(16)
    rundir.write_sealed(run_dir, RUN_FILE, json.dumps({"run_id": run_id}).encode(), secret)
    return derive_run_key(secret, run_id)


def run_key(run_dir: str, secret: bytes | None = None) -> bytes:
    """The current run's key (the store's and the snapshots' signing key)."""
    secret = load_secret(run_dir) if secret is None else secret
    record = rundir.read_sealed_json(run_dir, RUN_FILE, secret)
    if not isinstance(record, dict) or not isinstance(record.get("run_id"), str):
        raise rundir.UnsafeRunDir(f"{run_dir}/{RUN_FILE}: not a run record")
    return derive_run_key(secret, record["run_id"])
