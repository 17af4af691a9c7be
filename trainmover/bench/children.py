"""Benchmark child processes that each put one ``(rank, result)`` on a queue: collected with
a deadline, a failed or silent child reported as an error, every child stopped at the end
(``stop_children``, also the test harness's)."""
from __future__ import annotations

import os
import queue
import signal
import time


def collect(procs: list, out, what: str, timeout_s: float) -> dict:
    """``{rank: result}`` from every started process in ``procs`` via ``out``; raises
    ``RuntimeError`` naming ``what`` past ``timeout_s``, when one exits with an error, or
    when one exited cleanly without reporting for 120 s (the others are then stuck)."""
    results = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < len(procs):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} exceeded {timeout_s} s")
            try:
                rank, result = out.get(timeout=1.0)
                results[rank] = result
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"{what}: a process exited with code "
                                       f"{dead[0].exitcode}") from None
                if any(p.exitcode == 0 for p in procs) and time.monotonic() > deadline - \
                        timeout_s + 120 and len(results) < len(procs):
                    raise RuntimeError(f"{what}: a process exited without reporting; the "
                                       f"others are stuck") from None
    finally:
        stop_children(procs)
    return results


def stop_children(procs: list, grace_s: float = 5.0) -> None:
    """Join each process, killing by PID one still alive after ``grace_s``."""
    for p in procs:
        p.join(timeout=grace_s)
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
            p.join()


def run_pair(target, args: tuple, what: str, timeout_s: float) -> dict:
    """Two spawned processes ``target(rank, store_address, *args, out)`` over a store of
    their own (the gloo pair's rendezvous): ``{rank: result}`` (``collect``)."""
    import multiprocessing as mp

    from trainmover.comm.groups import start_store_server

    ctx = mp.get_context("spawn")
    store = start_store_server()
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, store.address, *args, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        return collect(procs, out, what, timeout_s)
    finally:
        store.close()
