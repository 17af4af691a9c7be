"""What makes two processes of a job the same job: its configuration, its training script,
and the data it trains on. Recorded once (``identity.json`` in the run dir, the data's digest
in the store as well) and checked by every process before it trains or warms up: a joiner
started after the script or the data file changed would otherwise train on other code or
tokens, silently, and a resumed job would not continue the run it claims to.

The configuration and script digests are taken by the controller when the job starts; the
data's by the first process that declares it (``Runtime.declare_data``: the built-in trainer
does, a script may), kept by the controller for a resume. Pure (hashlib only).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass

from trainmover.core import rundir

IDENTITY_FILE = "identity.json"
DATA_KEY = "job/data_sha256"   # store key: the data digest the first declaring process set


class IdentityMismatch(ValueError):
    """This process would not train the job's run: another configuration, script or data."""


@dataclass
class JobIdentity:
    config_sha256: str
    script_sha256: str | None = None    # None: the built-in trainer, or a module run with -m
    data_sha256: str | None = None      # None until a process declared its data


def config_digest(cfg_dict: dict) -> str:
    return hashlib.sha256(json.dumps(cfg_dict, sort_keys=True).encode()).hexdigest()


def script_digest(command: list[str]) -> str | None:
    """The training script's own code (a module run with -m is covered by its import path,
    not hashed)."""
    if not command or command[0] == "-m" or not os.path.isfile(command[0]):
        return None
    with open(command[0], "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def of_job(cfg_dict: dict, command: list[str]) -> JobIdentity:
    return JobIdentity(config_digest(cfg_dict), script_digest(command))


def write_identity(run_dir: str, identity: JobIdentity, secret: bytes) -> None:
    data = json.dumps(dataclasses.asdict(identity), indent=2).encode()
    rundir.write_sealed(run_dir, IDENTITY_FILE, data, secret)


def read_identity(run_dir: str, secret: bytes) -> JobIdentity:
    """The job's identity, its MAC checked. Missing is an error too: a job without one
    would skip the check (moving the file away was how a planted job.json got run)."""
    try:
        return JobIdentity(**json.loads(rundir.read_sealed(run_dir, IDENTITY_FILE, secret)))
    except FileNotFoundError:
        raise IdentityMismatch(f"{run_dir}/{IDENTITY_FILE} is missing: this process does "
                               f"not run a job it cannot identify") from None
    except (ValueError, TypeError) as exc:
        raise IdentityMismatch(f"{run_dir}/{IDENTITY_FILE} cannot be used: {exc}") from exc


def compare(job: JobIdentity, mine: JobIdentity, who: str) -> None:
    """Raise ``IdentityMismatch`` naming both digests of the first thing that differs."""
    for field, what in (("config_sha256", "configuration (job.json)"),
                        ("script_sha256", "training script")):
        theirs, ours = getattr(job, field), getattr(mine, field)
        if theirs != ours:
            raise IdentityMismatch(
                f"{who}: the job's {what} has sha256 {theirs}, this process's {ours}: it "
                f"changed since the job started; every process must run the same one")


def data_mismatch(who: str, job_digest: str, mine: str, description: str) -> IdentityMismatch:
    return IdentityMismatch(
        f"{who}: the job trains on data with sha256 {job_digest}, this process loaded "
        f"{description} with sha256 {mine}: the data changed since the job started; every "
        f"process must train on the same tokens")
