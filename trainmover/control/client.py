"""Talking to a running job from another process (``trainmover migrate``, ``trainmover
stop``): the job's store address is in ``<run dir>/control.json``; requests and answers go
through the store."""
from __future__ import annotations

import json
import os
import time

from trainmover.core import jobfile, storeaddr
from trainmover.core import protocol as P
from trainmover.core.auth import AuthStore, load_secret
from trainmover.core.proc import pid_alive

# How often a waiting `trainmover migrate` looks for the answer: a person is waiting, and a
# store read ten times a second costs the job nothing.
ANSWER_POLL_S = 0.1
# The controller writes the summary just after the job's agent exits (it stops the agent
# first): how long `trainmover stop` waits for it once the agent is gone.
SUMMARY_WAIT_S = 30.0


def connect(run_dir: str) -> AuthStore:
    """A client of the job's store that signs and checks values with the job's secret (the
    caller must be able to read the run dir's secret: the job's owner)."""
    path = os.path.join(run_dir, "control.json")
    if not os.path.exists(path):
        raise ValueError(f"{run_dir!r} is not the run dir of a running job (no control.json)")
    secret = load_secret(run_dir)
    address = jobfile.read_control(run_dir, secret)["store"]
    # written before control.json
    timeout_s = jobfile.read_job(run_dir, secret).comm.client_connect_timeout_s
    run_key = jobfile.run_key(run_dir, secret)
    try:
        store = storeaddr.connect(address, run_key, timeout_s)
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"the job in {run_dir!r} is not reachable at {address} "
                         f"(has it finished?): {exc}") from exc
    return AuthStore(store, run_key)


def request_migration(run_dir: str, workers: list[str], to: list[str] | None = None,
                      wait: bool = True, timeout_s: float = 600.0,
                      source: str = "cli") -> dict:
    """Queue a migration request; with ``wait``, block until it is done, refused or aborted."""
    store = connect(run_dir)
    index = store.add(P.REQUEST_COUNT_KEY, 1)
    store.set(P.request_key(index), P.write_message(P.MigrationAsk(list(workers), to, source)))
    deadline = time.monotonic() + timeout_s
    status = {"status": "queued"}
    while time.monotonic() < deadline:
        if store.check([P.request_key(index, "done")]):
            answer = P.read_object(store.get(P.request_key(index, "done")))
            for what in ("", "status", "done"):   # answered: nobody reads them again
                store.delete_key(P.request_key(index, what))
            return answer
        if store.check([P.request_key(index, "status")]):
            status = P.read_object(store.get(P.request_key(index, "status")))
            if not wait:
                return status
        time.sleep(ANSWER_POLL_S)
    return {**status, "status": "timeout", "reason": f"no answer within {timeout_s} s"}


def request_stop(run_dir: str, reason: str = "trainmover stop", wait: bool = True,
                 timeout_s: float = 600.0) -> dict:
    """Ask the job to stop gracefully; with ``wait``, block until every process of it exited
    and return its summary (``stopped``, ``resume_step``)."""
    store = connect(run_dir)
    t_asked = time.time()
    store.set(P.STOP_REQUEST_KEY, P.write_message(P.StopAsk(reason)))
    if not wait:
        return {"status": "requested"}
    agent = jobfile.read_control(run_dir)["agent_pid"]
    deadline = time.monotonic() + timeout_s
    while pid_alive(agent):
        if time.monotonic() > deadline:
            return {"status": "timeout", "reason": f"the job still runs after {timeout_s} s"}
        time.sleep(ANSWER_POLL_S)
    path = os.path.join(run_dir, "summary.json")
    deadline = time.monotonic() + SUMMARY_WAIT_S
    while not (os.path.exists(path) and os.path.getmtime(path) >= t_asked):
        if time.monotonic() > deadline:
            return {"status": "failed", "reason": f"the job ended without a summary: see "
                                                  f"{run_dir}/events.jsonl"}
        time.sleep(ANSWER_POLL_S)
    with open(path) as f:
        summary = json.load(f)
    return {"status": "stopped" if summary.get("stopped") else "finished", **summary}

