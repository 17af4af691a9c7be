"""Maintenance from outside a running job: ``trainmover drain`` moves workers off their
machines onto standbys, batch by batch, as many at once as there are free standbys."""
from __future__ import annotations

from trainmover.control.client import connect, request_migration
from trainmover.control.status import read_status
from trainmover.core.accounting import downtime_phrase


def drain(run_dir: str, workers: list[str] | None = None, host: int | None = None,
          timeout_s: float = 600.0, say=print) -> dict:
    """Move ``workers`` (and every worker on host ``host``) off their machines: as many at
    once as there are free standbys (one planned migration per batch, its pairs switching
    together), batch after batch. Returns ``{"status", "moved", "batches"}``; a worker named
    twice or unknown is refused before anything moves."""
    store = connect(run_dir)
    st = read_status(run_dir, store)
    holders = {w.name: w for w in st.workers}
    wanted = list(dict.fromkeys(workers or []))
    unknown = [w for w in wanted if w not in holders]
    if unknown:
        raise ValueError(f"drain: {unknown} hold no role in the job (workers: "
                         f"{sorted(holders)})")
    if host is not None:
        on_host = [w.name for w in st.workers if w.node == host]
        if not on_host:
            raise ValueError(f"drain: no worker runs on host {host}")
        wanted += [w for w in on_host if w not in wanted]
    if not wanted:
        raise ValueError("drain: name --worker or --host")
    moved, batches = [], []
    while len(moved) < len(wanted):
        st = read_status(run_dir, store)
        free = [s.name for s in st.standbys if s.alive and s.state in ("warm", "warming", "cold")
                and (host is None or s.node != host)]
        if not free:
            return {"status": "stalled", "reason": "no free standby (on another host)",
                    "moved": moved, "batches": batches}
        batch = [w for w in wanted if w not in moved][:len(free)]
        say(f"draining {', '.join(batch)} -> {', '.join(free[:len(batch)])}")
        result = request_migration(run_dir, batch, free[:len(batch)], timeout_s=timeout_s,
                                   source="drain")
        batches.append(result)
        if result.get("status") != "done":
            return {"status": result.get("status", "failed"), "reason": result.get("reason"),
                    "moved": moved, "batches": batches}
        moved += batch
        say(f"free: {', '.join(batch)} ("   # worded as everywhere (core/accounting.py)
            f"{downtime_phrase(result.get('downtime_s'), result.get('downtime_noise_s'))})")
    return {"status": "done", "moved": moved, "batches": batches}
