"""What ``trainmover demo`` adds to a plain run: a planned migration mid-run, and a summary
that sets its downtime beside what a restart costs on the same job."""
from __future__ import annotations

import os

from trainmover.core.accounting import downtime_value, within_noise
from trainmover.core.config import JobConfig
from trainmover.core.events import read_jsonl
from trainmover.core.faults import Inject


def demo_injects(cfg: JobConfig) -> list[Inject]:
    """A planned migration of w1 a third of the way in, then an unexpected crash of w2 (killed
    in the middle of its backward pass) two thirds of the way in."""
    out = []
    if cfg.standby.count >= 1:
        out.append(Inject("migrate", cfg.train.steps // 3, "w1"))
    if cfg.standby.count >= 2 and cfg.layout.num_roles > 2:
        out.append(Inject("crash", 2 * cfg.train.steps // 3, "w2", "backward"))
    return out


def cold_start_s(run_dir: str) -> float | None:
    """This job's own cold start: from the coordinator starting the job to the end of step
    0, minus a normal step: what a restart pays (fresh processes, imports, every group,
    model build, first-step warm-up) besides loading a checkpoint. An estimate: the standbys
    start at the same time and share the machine, which slows this start-up. With the fork
    server the imports are counted once (its own, not every new process's at once as in a
    real restart): an estimate in restart's favour."""
    events = read_jsonl(os.path.join(run_dir, "events.jsonl"))
    metrics = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    start = next((e["time"] for e in events if e["event"] == "job_started"), None)
    if start is None or len(metrics) < 3:
        return None
    normal = sorted(m["step_time_s"] for m in metrics[1:])[len(metrics[1:]) // 2]
    ready = next((e for e in events if e["event"] == "fork_server_ready"), None)
    if ready is not None:
        # forked workers skip the imports a restart's new processes pay: the fork server's
        # own import time stands for them, then the workers' time from their start
        started = min(e["time"] for e in events if e["event"] == "process_started")
        return ready["import_s"] + metrics[0]["time"] - started - normal
    return metrics[0]["time"] - start - normal


def print_demo_summary(cfg: JobConfig, run_dir: str, summary: dict) -> None:
    print()
    print(f"demo finished: {summary['steps']} steps on {cfg.layout} "
          f"({summary['workers']} workers, {summary['standbys']} standby), final loss "
          f"{summary['final_loss']:.4f}")
    if summary["mean_step_time_s"]:
        print(f"  mean step time      {summary['mean_step_time_s'] * 1000:.1f} ms")
    restart = cold_start_s(run_dir)
    for m in summary["migrations"]:
        if m["status"] != "done":
            print(f"  migration {m['migration_id']}: {m['status']} ({m.get('reason', '')})")
            continue
        pairs = ", ".join(f"{p['leaver']} -> {p['joiner']} ({p['role']})" for p in m["pairs"])
        ph = m["phases"]
        print(f"  planned migration   {pairs} at step {m['switch_step']}")
        # worded as everywhere else (core/accounting.py): inside the step noise, no number
        noise = m.get("downtime_noise_s")
        stall = m["downtime_s"] is not None and not within_noise(m["downtime_s"], noise)
        print(f"    downtime          {downtime_value(m['downtime_s'], noise)}")
        print(f"      state transfer  {ph['transfer_s']:.3f} s ({m['transfer_bytes'] / 1e6:.1f} MB)")
        print(f"      group switch    {ph['group_switch_s']:.3f} s "
              f"({m['groups_rebuilt']}/{m['groups_total']} groups rebuilt, prepared while "
              f"training went on: {ph['prepare_s']:.2f} s)")
        normal = ph.get("normal_train_step_s")
        print(f"      joiner's first step {ph['first_step_s']:.3f} s" +
              (f" (a normal step {normal:.3f} s)" if normal is not None else ""))
        if restart is not None:
            # an estimate, not a bound: standbys start beside the workers and slow them
            print(f"    a restart         about {restart:.2f} s on this job (estimated from "
                  f"its own start-up, checkpoint load not included)" +
                  (f": {restart / m['downtime_s']:.0f}x the migration's downtime" if stall
                   else ""))
    for r in summary.get("recoveries", []):
        failed = ", ".join(f"{w} ({k})" for w, k in r["failures"].items())
        pairs = ", ".join(f"{p['joiner']} took {p['role']}" for p in r["pairs"])
        print(f"  unexpected failure  {failed}: {pairs}")
        print(f"    detection         {max(r['detection_latency_s'].values()):.3f} s")
        print(f"    downtime          {downtime_value(r['downtime_s'], None)} (fault to first "
              f"committed step; step {r['resume_step']} redone, {r['lost_steps']} committed "
              f"steps lost)")
        print(f"    state from        {', '.join(sorted(set(r['sources'].values())))}; "
              f"{r['groups_rebuilt']}/{r['groups_total']} groups rebuilt")
        if restart is not None and r["downtime_s"] is not None and \
                not within_noise(r["downtime_s"], None):
            print(f"    a restart         about {restart:.2f} s (estimated, as above): "
                  f"{restart / r['downtime_s']:.0f}x this recovery")
    print(f"  weights sha256      {summary['weights_sha256']}")
    print(f"  run dir             {os.path.abspath(run_dir)}  (metrics.jsonl, events.jsonl, "
          f"summary.json, final/checkpoint)")
