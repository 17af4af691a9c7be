"""The job's files in its run dir that say what runs: ``job.json`` (the configuration, the
command included) and ``control.json`` (where the store is, the agent's PID), each read only
from a run dir that passes ``rundir.check_dir`` and only once its MAC under the job's secret
checks (``core/rundir.py``)."""
from __future__ import annotations

import json

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
