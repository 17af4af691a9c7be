"""Runs a function in N spawned processes around one store hosted by the test, with a hard
deadline: on timeout every child is killed by PID and the test fails instead of hanging."""
from __future__ import annotations

import multiprocessing as mp
import queue
import time
import traceback

from trainmover.bench.children import stop_children
from trainmover.comm.groups import start_store_server


def _entry(fn, rank, address, args, results):
    import torch

    torch.set_num_threads(1)
    try:
        results.put((rank, "ok", fn(rank, address, *args)))
    except BaseException as exc:  # noqa: BLE001 - report everything to the parent
        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


# The processes are forked from one server process started at the first call, which has
# imported torch (and torch._dynamo, which any optimizer's first use imports) once for the
# whole test session: a spawned process imported them anew, 4-5 s of CPU each, which was most
# of these tests' time (a 12-process test imported torch 12 times on 2 cores). A child still
# starts clean: the server runs no test code, only imports, and holds no thread to fork.
_PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "trainmover.comm.groups", "mp_harness"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def run_processes(fn, nprocs: int, *args, timeout: float = 60.0, expect: int | None = None):
    """Returns {rank: ("ok", value) | ("error", text)} for the ranks that reported; waits for
    ``expect`` reports (default all ranks)."""
    ctx = _context()
    store = start_store_server()
    address = store.address       # with the run key its clients authenticate with
    results = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(fn, r, address, args, results), daemon=True)
             for r in range(nprocs)]
    for p in procs:
        p.start()
    out = {}
    deadline = time.monotonic() + timeout
    want = nprocs if expect is None else expect
    try:
        while len(out) < want:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"only {len(out)}/{want} processes reported within "
                                   f"{timeout} s: {sorted(out)}")
            try:
                rank, status, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            out[rank] = (status, value)
    finally:
        stop_children(procs)
        store.close()
    return out


def values(results: dict) -> dict:
    errors = {r: v for r, (s, v) in results.items() if s != "ok"}
    assert not errors, errors
    return {r: v for r, (s, v) in results.items()}


def wait_for(cond, timeout_s: float, what: str) -> None:
    """Poll ``cond`` until it holds; fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def set_migration_downtime(run_dir: str, downtime_s: float, noise_s: float) -> None:
    """Rewrite the one ``migration_done`` of a recorded run dir's events: what the views
    must word (a downtime inside the step noise, say)."""
    import json
    import os

    events = os.path.join(run_dir, "events.jsonl")
    with open(events) as f:
        records = [json.loads(ln) for ln in f]
    (done,) = [e for e in records if e["event"] == "migration_done"]
    done.update(downtime_s=downtime_s, downtime_noise_s=noise_s)
    with open(events, "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in records)
