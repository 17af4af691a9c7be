"""``trainmover bench torchft``: trainmover and torchft side by side on the same machine, in
one run: the same model, data and data-parallel-only layout (torchft replicates data
parallelism only), one replica's process killed (SIGKILL) once training is steady.

For each system: the time from the kill to training at full width again (every replica in a
committed step), the survivors' stall (their longest gap between committed steps around the
kill, minus a normal one), and how many samples were skipped (a step committed by fewer
replicas trains on fewer batch shards; the missing shards are never seen again).

torchft is driven as its users run it: a lighthouse, one replica group per process (a
``Manager`` with its own store, ``torchft.DistributedDataParallel``, the commit check before
the optimizer step), and the killed replica relaunched at once by the harness (the
scheduler's part, here as fast as it can be) to heal from a live peer. trainmover runs the
same layout with one warm standby. torchft is an optional extra (``pip install torchft``):
without it the benchmark stops with a message saying so.

``python -m trainmover.bench.torchft_side replica ...`` is one torchft replica process.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

# torchft's settings, recorded with the result: its defaults, and tuned for fast recovery
TORCHFT_SETTINGS = {
    "default": {"timeout_s": 60.0, "quorum_timeout_s": 60.0, "connect_timeout_s": 60.0,
                "lighthouse_join_timeout_ms": None, "lighthouse_heartbeat_timeout_ms": None,
                "lighthouse_quorum_tick_ms": None},
    "tuned": {"timeout_s": 5.0, "quorum_timeout_s": 10.0, "connect_timeout_s": 10.0,
              "lighthouse_join_timeout_ms": 500, "lighthouse_heartbeat_timeout_ms": 1000,
              "lighthouse_quorum_tick_ms": 50},
}


def torchft_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("torchft")
    except Exception:  # noqa: BLE001 - not installed, or no metadata
        return None


# --- one torchft replica ---------------------------------------------------------------------

def replica_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--replica", type=int, required=True)
    p.add_argument("--replicas", type=int, required=True)
    p.add_argument("--lighthouse", required=True)
    p.add_argument("--recipe", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--settings", required=True, help="a JSON object (TORCHFT_SETTINGS)")
    args = p.parse_args(argv)
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torchft import Manager, ProcessGroupGloo

    from trainmover.comm.groups import GroupBuilder, StoreClients, build_comm_groups, \
        start_store_server
    from trainmover.core.topology import Layout, Role
    from trainmover.recipes import get_recipe
    from trainmover.train.data import BatchSource, load_tokens
    from trainmover.train.engine import adamw, lr_at
    from trainmover.train.model import GPTStage

    torch.set_num_threads(1)
    settings = json.loads(args.settings)
    cfg = get_recipe(args.recipe)
    tc = cfg.train
    # the model exactly as trainmover builds a one-stage, one-shard role
    local = Layout()
    builder = GroupBuilder(StoreClients(start_store_server().address), torch.device("cpu"),
                           60.0)
    # torchft's manager speaks TCPStore's protocol to a store of its own
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    groups, _ = build_comm_groups(builder, local, Role(0, 0, 0))   # trivial: no traffic
    model = GPTStage(cfg.model, local, 0, 0, groups)
    model.init_weights(tc.seed)
    opt = adamw(list(model.parameters()), tc)

    def state_dict():
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=settings["timeout_s"])),
        load_state_dict=load_state_dict, state_dict=state_dict, min_replica_size=1,
        timeout=timedelta(seconds=settings["timeout_s"]),
        quorum_timeout=timedelta(seconds=settings["quorum_timeout_s"]),
        connect_timeout=timedelta(seconds=settings["connect_timeout_s"]),
        rank=0, world_size=1, store_addr="127.0.0.1", store_port=store.port,
        lighthouse_addr=args.lighthouse, replica_id=f"replica{args.replica}",
        hostname="127.0.0.1", init_sync=False)
    params = [q for q in model.parameters() if q.requires_grad]
    batches = BatchSource(load_tokens(cfg.data), cfg.model.seq_len, tc.global_batch, tc.seed,
                          cfg.model.vocab_size)
    m = tc.num_microbatches
    with open(args.log, "a") as log:
        while manager.current_step() < args.steps:
            step = manager.current_step()
            opt.zero_grad(set_to_none=False)
            manager.start_quorum()
            # each replica reads its own shard of the step's batch (by its replica id, as
            # torchft's DistributedSampler does): a missing replica's shard is not trained on
            x, y = batches.batch(step, args.replica, args.replicas)
            for xi, yi in zip(x.chunk(m), y.chunk(m)):
                (model.loss(model(xi), yi) / m).backward()
            # the gradients averaged over the quorum's replicas, one buffer (as DDP's buckets
            # would after the last micro-batch); torchft's DDP wrapper is not used: its
            # communication hook asserts on a failed all-reduce in this version instead of
            # letting the manager report it
            flat = torch.cat([q.grad.reshape(-1) for q in params])
            manager.allreduce(flat).wait()
            offset = 0
            for q in params:
                q.grad.copy_(flat[offset:offset + q.numel()].view_as(q.grad))
                offset += q.numel()
            torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
            for g in opt.param_groups:
                g["lr"] = lr_at(step, tc.lr, tc.min_lr, tc.warmup_steps, tc.steps)
            committed = manager.should_commit()
            if committed:
                opt.step()
            log.write(json.dumps({"replica": args.replica, "step": step, "t": time.time(),
                                  "committed": committed,
                                  "participants": manager.num_participants()}) + "\n")
            log.flush()
    manager.shutdown(wait=False)
    os._exit(0)   # no teardown: a process group destructor may wait on a dead peer


# --- the harness --------------------------------------------------------------------------------

def _spawn_replica(i: int, n: int, lighthouse: str, recipe: str, steps: int, log: str,
                   settings: dict, out_dir: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "RUST_LOG": os.environ.get("RUST_LOG", "warn")}
    stderr = open(os.path.join(out_dir, f"replica{i}.err"), "a")
    return subprocess.Popen(
        [sys.executable, "-m", "trainmover.bench.torchft_side", "replica", "--replica", str(i),
         "--replicas", str(n), "--lighthouse", lighthouse, "--recipe", recipe,
         "--steps", str(steps), "--log", log, "--settings", json.dumps(settings)],
        env=env, stdout=stderr, stderr=stderr)


def _read(log: str) -> list[dict]:
    if not os.path.exists(log):
        return []
    with open(log) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_torchft(n: int, recipe: str, kill_after: int, steps_after: int, victim: int,
                settings: dict, out_dir: str, timeout_s: float = 600.0) -> dict:
    """One torchft job of ``n`` replicas; ``victim`` killed once every replica committed
    ``kill_after`` steps at full width, relaunched at once; runs until ``steps_after``
    steps committed at full width after the kill."""
    os.environ.setdefault("RUST_LOG", "warn")   # torchft logs every quorum at info level
    from torchft.coordination import LighthouseServer

    os.makedirs(out_dir, exist_ok=True)
    lh_args = {k: settings[f"lighthouse_{k}"] for k in
               ("join_timeout_ms", "heartbeat_timeout_ms", "quorum_tick_ms")
               if settings.get(f"lighthouse_{k}") is not None}
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, **lh_args)
    log = os.path.join(out_dir, "steps.jsonl")
    total = 100_000
    procs = {i: _spawn_replica(i, n, lighthouse.address(), recipe, total, log, settings,
                               out_dir) for i in range(n)}
    deadline = time.monotonic() + timeout_s
    t_kill = relaunched = None
    try:
        while True:
            if time.monotonic() > deadline:
                raise RuntimeError(f"torchft run exceeded {timeout_s} s; see {out_dir}")
            rows = _read(log)
            full = [r for r in rows if r["committed"] and r["participants"] == n]
            if t_kill is None:
                if len({r["step"] for r in full}) >= kill_after:
                    procs[victim].send_signal(signal.SIGKILL)
                    t_kill = time.time()
                    procs[victim].wait()
                    procs[victim] = _spawn_replica(victim, n, lighthouse.address(), recipe,
                                                   total, log, settings, out_dir)
                    relaunched = time.time()
            elif len({r["step"] for r in full if r["t"] > t_kill}) >= steps_after:
                break
            for i, p in procs.items():
                if p.poll() is not None and p.returncode != 0 and \
                        not (i == victim and t_kill is not None and p.returncode < 0):
                    raise RuntimeError(f"torchft replica {i} exited with {p.returncode}; see "
                                       f"{out_dir}/replica{i}.err")
            time.sleep(0.1)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        lighthouse.shutdown()
    return summarize_torchft(_read(log), n, victim, t_kill, cfg_batch_per_replica(recipe, n)) \
        | {"relaunched_after_s": relaunched - t_kill}


def cfg_batch_per_replica(recipe: str, n: int) -> int:
    from trainmover.recipes import get_recipe

    return get_recipe(recipe).train.global_batch // n


def summarize_torchft(rows: list[dict], n: int, victim: int, t_kill: float,
                      per_replica: int) -> dict:
    """From every replica's per-step log: the survivors' stall, kill to full width, and the
    samples skipped (shards of replicas missing from committed steps)."""
    survivors = sorted({r["replica"] for r in rows} - {victim})
    stalls, normals = [], []
    for i in survivors:
        commits = sorted(r["t"] for r in rows if r["replica"] == i and r["committed"])
        before = [t for t in commits if t <= t_kill][-11:]
        after = [t for t in commits if t > t_kill]
        if len(before) < 3 or not after:
            continue
        normal = statistics.median(b - a for a, b in zip(before, before[1:]))
        normals.append(normal)
        stalls.append(after[0] - before[-1] - normal)
    # full width again: the first full-width commit after the last one below full width (a
    # step in flight when the replica died can still commit at full width just after the
    # kill, its all-reduce done: that is not the job back at full width)
    after = [r for r in rows if r["t"] > t_kill and r["committed"]]
    below = [r["t"] for r in after if r["participants"] < n]
    full_again = min((r["t"] for r in after if r["participants"] == n and
                      r["t"] > max(below, default=t_kill)), default=None)
    # one entry per committed step (every participant logs it with the same count)
    steps = {}
    for r in rows:
        # after the kill only: replicas that start a moment apart commit a few steps below
        # full width at the beginning too, which is not the failure's doing
        if r["committed"] and r["t"] > t_kill:
            steps[r["step"]] = min(steps.get(r["step"], n), r["participants"])
    skipped = sum((n - p) * per_replica for p in steps.values())
    discarded = len({r["step"] for r in rows if not r["committed"] and r["t"] > t_kill})
    return {"survivor_stall_s": max(stalls) if stalls else None,
            "normal_step_s": statistics.median(normals) if normals else None,
            "kill_to_full_width_s": None if full_again is None else full_again - t_kill,
            "samples_skipped": skipped,
            "steps_below_full_width": sum(1 for p in steps.values() if p < n),
            "steps_discarded": discarded}


def run_trainmover(n: int, recipe: str, kill_after: int, steps_after: int, victim: str,
                   run_dir: str, timeout_s: float = 600.0) -> dict:
    """The same layout under trainmover, one warm standby, ``victim`` SIGKILLed once the job
    committed ``kill_after`` steps (and the standby is warm)."""
    from trainmover.api import Job
    from trainmover.bench.downtime import normal_gap_before, wait_for
    from trainmover.core import decisions as C
    from trainmover.core.events import read_jsonl
    from trainmover.core.topology import Layout
    from trainmover.recipes import get_recipe

    cfg = get_recipe(recipe)
    cfg.layout = Layout(n, 1, 1)
    cfg.standby.count = 1
    cfg.train.steps = 100_000
    cfg.controller.restart, cfg.controller.grace_s = "manual", 30.0
    cfg.validate()
    job = Job(cfg, run_dir, timeout_s=timeout_s).start()
    coord = job.coordinator
    try:
        wait_for(lambda: all(st is C.StandbyState.WARM
                             for st in coord.membership.standbys.values())
                 and coord.progress.last_step >= kill_after, job, "a warm standby", timeout_s)
        t_kill = time.time()
        os.kill(coord.procs.pid(victim), signal.SIGKILL)
        wait_for(lambda: coord.recovery.done, job, "the recovery", timeout_s)
        resume = coord.recovery.done[0]["resume_step"]
        wait_for(lambda: coord.progress.last_step >= resume + steps_after, job, "steps after",
                 timeout_s)
    finally:
        coord.stop()
    summary = job.wait(600)
    (rec,) = summary["recoveries"]
    commits = sorted(r["time"] for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl")))
    last_before = max(t for t in commits if t <= t_kill)
    normal = normal_gap_before(run_dir, t_kill, steps=10)
    first_after = min(t for t in commits if t > t_kill)
    return {"survivor_stall_s": first_after - last_before - normal, "normal_step_s": normal,
            # a recovery restores the role before any step commits: full width again at the
            # first step committed after the kill
            "kill_to_full_width_s": first_after - t_kill,
            "samples_skipped": rec["lost_steps"] * cfg.train.global_batch,
            "lost_steps": rec["lost_steps"], "recovery_downtime_s": rec["downtime_s"],
            "steps_committed": summary["steps"]}


def bench_torchft(replicas: int, recipe: str, repeats: int, kill_after: int, steps_after: int,
                  out_dir: str, scratch: str | None = None) -> dict:
    import tempfile

    from trainmover.bench.report import (BenchLine, git_commit, machine_description, spread,
                                         write_result)

    version = torchft_version()
    if version is None:
        raise ValueError("bench torchft needs torchft (`pip install torchft`, or the "
                         "project's `torchft` extra); it is not installed here")
    if replicas < 2:
        raise ValueError(f"--replicas {replicas}: need at least 2 (one is killed)")
    from trainmover.core.topology import Layout
    from trainmover.recipes import get_recipe

    cfg = get_recipe(recipe)
    cfg.layout = Layout(replicas, 1, 1)
    try:
        cfg.validate()
    except ValueError as exc:
        raise ValueError(f"--replicas {replicas} with --recipe {recipe}: {exc}") from None
    scratch = scratch or tempfile.mkdtemp(prefix="tm-bench-torchft-")
    runs = []
    line = BenchLine("bench torchft", repeats * 3)
    for rep in range(repeats):
        for system in ("trainmover", "torchft_default", "torchft_tuned"):
            line.start(f"{system}, round {rep + 1}")
            where = os.path.join(scratch, f"{system}-r{rep}")
            t0 = time.perf_counter()
            try:
                if system == "trainmover":
                    res = run_trainmover(replicas, recipe, kill_after, steps_after, "w1", where)
                else:
                    res = run_torchft(replicas, recipe, kill_after, steps_after, 1,
                                      TORCHFT_SETTINGS[system.split("_")[1]], where)
            except RuntimeError as exc:
                res = {"error": str(exc)[:500]}
            runs.append({"system": system, "repeat": rep, "bench_wall_s":
                         time.perf_counter() - t0, **res})
            line.finish(f"  round {rep + 1}/{repeats} {system:>16}: " + (
                f"kill to full width {res['kill_to_full_width_s']:.2f} s, stall "
                f"{res['survivor_stall_s']:.2f} s, {res['samples_skipped']} samples skipped"
                if "error" not in res else f"FAILED: {res['error']}"))
    line.close()
    cells = {}
    for system in ("trainmover", "torchft_default", "torchft_tuned"):
        ok = [r for r in runs if r["system"] == system and "error" not in r]
        cells[system] = {"runs": len(ok), "failed": sum(1 for r in runs if r["system"] ==
                                                         system and "error" in r)}
        for key in ("kill_to_full_width_s", "survivor_stall_s", "samples_skipped",
                    "normal_step_s"):
            vals = [r[key] for r in ok if r.get(key) is not None]
            cells[system][key] = spread(vals) if vals else None
    result = {"benchmark": "torchft", "torchft_version": version, "replicas": replicas,
              "recipe": recipe, "repeats": repeats, "kill_after": kill_after,
              "steps_after": steps_after, "torchft_settings": TORCHFT_SETTINGS,
              "cells": cells, "results": runs, "commit": git_commit(),
              "machine": machine_description(), "scratch": scratch}
    write_result(out_dir, "torchft", result, _table(result))
    return result


def _table(r: dict) -> str:
    from trainmover.bench.report import fmt_spread

    lines = [f"# trainmover vs torchft {r['torchft_version']}: one replica killed (commit "
             f"{r['commit']})", "",
             f"Recipe `{r['recipe']}`, data parallel only ({r['replicas']} replicas, one "
             f"process each, one thread each), the same model, data and optimizer; replica 1 "
             f"SIGKILLed after {r['kill_after']} steps at full width. trainmover: one warm "
             f"standby. torchft: a lighthouse, one Manager per replica, the killed replica "
             f"relaunched at once by the harness and healed from a live peer. "
             f"{r['repeats']} repeats, median (min-max).", "",
             "| system | kill to full width (s) | survivors' stall (s) | samples skipped | "
             "normal step (s) |", "|---|---|---|---|---|"]
    for system, c in r["cells"].items():
        lines.append(f"| {system} | {fmt_spread(c['kill_to_full_width_s'], 2)} | "
                     f"{fmt_spread(c['survivor_stall_s'], 2)} | "
                     f"{fmt_spread(c['samples_skipped'], 0)} | "
                     f"{fmt_spread(c['normal_step_s'], 3)} |" +
                     (f" ({c['failed']} failed)" if c["failed"] else ""))
    lines += ["", "torchft settings (None: torchft's own default):", ""]
    lines += [f"- {k}: " + ", ".join(f"{n} {v}" for n, v in s.items())
              for k, s in r["torchft_settings"].items()]
    m = r["machine"]
    lines += ["", f"machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if sys.argv[1:2] == ["replica"]:
        sys.exit(replica_main(sys.argv[2:]))
    raise SystemExit("usage: python -m trainmover.bench.torchft_side replica ...")
