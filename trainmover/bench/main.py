"""Benchmarks. Results go under ``benchmarks/results/``; each compares strategies measured side
by side in one run (interleaved repeats), because this machine is shared and noisy.

``bench step``: the engine's training step in a DP-only layout against plain
``DistributedDataParallel`` over gloo: same model code, batch, micro-batches, optimizer,
clipping and processes. Only the step loop differs.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time

import torch

from trainmover.comm.groups import GroupBuilder, StoreAddress, StoreClients, build_comm_groups, start_store_server
from trainmover.core.config import JobConfig
from trainmover.train.data import BatchSource, load_tokens
from trainmover.train.engine import Engine, adamw, lr_at
from trainmover.bench.children import collect
from trainmover.bench.report import git_commit, machine_description, write_result
from trainmover.core.events import read_jsonl
from trainmover.recipes import get_recipe
from trainmover.core.topology import Layout, Role

WARMUP_STEPS = 5




def _engine_steps(cfg: JobConfig, rank: int, address: StoreAddress,
                  record_first: bool = False, commit: bool = True) -> list[float]:
    """The engine's steps as a job runs them: abortable waits and the commit vote (unless
    ``commit`` is off); with ``record_first``, step 0 runs under the warm-up recorder exactly
    as in a job with standbys (the recorder is removed afterwards)."""
    from trainmover.comm.groups import AbortSignal
    from trainmover.worker.liveness import CommitVote
    from trainmover.comm.record import Recorder

    role = cfg.layout.role_of(rank)
    stores = StoreClients(address)
    builder = GroupBuilder(stores, torch.device("cpu"), cfg.comm.group_timeout_s,
                           abort_signal=AbortSignal() if commit else None)
    groups, _ = build_comm_groups(builder, cfg.layout, role)
    data = load_tokens(cfg.data)
    batches = BatchSource(data, cfg.model.seq_len, cfg.train.global_batch, cfg.train.seed,
                          cfg.model.vocab_size)
    engine = Engine(cfg, role, groups, batches, torch.device("cpu"))
    vote = CommitVote(stores, cfg.layout.num_roles, epoch=0, voter=f"w{rank}") if commit \
        else None
    times = []
    for step in range(cfg.train.steps):
        commit = None if vote is None else (lambda s=step, **info: vote(s, info))
        if step == 0 and record_first:
            with Recorder(groups):
                times.append(engine.train_step(step, commit).step_time_s)
        else:
            times.append(engine.train_step(step, commit).step_time_s)
    groups.shutdown()
    return times


def _recorded_engine_steps(cfg: JobConfig, rank: int, address: StoreAddress) -> list[float]:
    return _engine_steps(cfg, rank, address, record_first=True)


def _engine_steps_no_commit(cfg: JobConfig, rank: int, address: StoreAddress) -> list[float]:
    return _engine_steps(cfg, rank, address, commit=False)


def _ddp_steps(cfg: JobConfig, rank: int, address: StoreAddress) -> list[float]:
    """The reference loop a DDP user writes: no_sync for all but the last micro-batch,
    clip_grad_norm_, AdamW, and the loss averaged over replicas for logging."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainmover.train.model import GPTStage

    store = StoreClients(address).raw()
    dist.init_process_group("gloo", store=dist.PrefixStore("ddp/", store), rank=rank,
                            world_size=cfg.layout.dp)
    local = Layout()
    builder = GroupBuilder(StoreClients(address), torch.device("cpu"),
                           cfg.comm.group_timeout_s)
    groups, _ = build_comm_groups(builder, local, Role(0, 0, 0))  # trivial: no TP traffic
    model = GPTStage(cfg.model, local, 0, 0, groups)
    model.init_weights(cfg.train.seed)
    ddp = DDP(model, bucket_cap_mb=cfg.train.bucket_mb)
    tc = cfg.train
    opt = adamw(list(model.parameters()), tc)
    data = load_tokens(cfg.data)
    batches = BatchSource(data, cfg.model.seq_len, tc.global_batch, tc.seed, cfg.model.vocab_size)
    m = tc.num_microbatches
    times = []
    for step in range(tc.steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        x, y = batches.batch(step, rank, cfg.layout.dp)
        total = torch.zeros(())
        for i, (xi, yi) in enumerate(zip(x.chunk(m), y.chunk(m))):
            if i < m - 1:
                with ddp.no_sync():
                    loss = model.loss(ddp(xi), yi) / m
                    loss.backward()
            else:
                loss = model.loss(ddp(xi), yi) / m
                loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, tc.lr, tc.min_lr, tc.warmup_steps, tc.steps)
        opt.step()
        dist.all_reduce(total)
        times.append(time.perf_counter() - t0)
    return times


_STRATEGIES = {"trainmover": _engine_steps, "trainmover_recorded": _recorded_engine_steps,
               "trainmover_no_commit": _engine_steps_no_commit, "ddp": _ddp_steps}
JOB = "trainmover_job"


def _job_steps(cfg: JobConfig, timeout_s: float) -> list[float]:
    """The built-in trainer as `trainmover run` runs it: controller, agent, workers, the
    runtime API's step loop with the commit vote, metrics and heartbeats. A step's time is
    commit to commit as the reporter (dp rank 0) records them, so everything the runtime
    does between steps is counted."""
    import tempfile

    from trainmover.control.coordinator import run_job

    with tempfile.TemporaryDirectory(prefix="tm-bench-step-") as scratch:
        run_job(cfg, os.path.join(scratch, "run"), quiet=True, timeout_s=timeout_s)
        records = read_jsonl(os.path.join(scratch, "run", "metrics.jsonl"))
    t = [r["time"] for r in sorted(records, key=lambda r: r["step"])]
    return [b - a for a, b in zip(t, t[1:])]


def _child(strategy: str, cfg_dict: dict, rank: int, address: StoreAddress, threads: int,
           out: mp.Queue) -> None:
    torch.set_num_threads(threads)
    cfg = JobConfig.from_dict(cfg_dict)
    out.put((rank, _STRATEGIES[strategy](cfg, rank, address)))
    out.close()
    out.join_thread()  # the result is in the pipe
    # Skip teardown: a process-group destructor can wait on its peers' sockets, which hung
    # one rank at exit in about one run in ten; nothing is left to clean up.
    os._exit(0)


def run_strategy(strategy: str, cfg: JobConfig, timeout_s: float = 600) -> list[float]:
    """Per-step times of rank 0, from fresh processes."""
    ctx = mp.get_context("spawn")
    store = start_store_server()
    address = store.address
    out = ctx.Queue()
    threads = cfg.threads_per_worker()
    procs = [ctx.Process(target=_child, args=(strategy, cfg.to_dict(), r, address, threads, out))
             for r in range(cfg.layout.num_roles)]
    for p in procs:
        p.start()
    try:
        return collect(procs, out, f"bench strategy {strategy}", timeout_s)[0]
    finally:
        store.close()


def bench_step(recipe: str = "bench_step", dp: int = 2, steps: int = 30, repeats: int = 3,
               out_dir: str = "benchmarks/results") -> dict:
    cfg = get_recipe(recipe)
    cfg.layout = Layout(dp, 1, 1)
    cfg.train.steps = steps
    cfg.validate()
    if steps <= WARMUP_STEPS + 2:
        raise ValueError(f"--steps must exceed {WARMUP_STEPS + 2}, got {steps}")
    rows = []
    names = tuple(_STRATEGIES) + (JOB,)
    for rep in range(repeats):
        # interleave, rotating the order: a slow phase of the shared machine hits all alike
        k = rep % len(names)
        for strategy in names[k:] + names[:k]:
            times = (_job_steps(cfg, 600) if strategy == JOB else
                     run_strategy(strategy, cfg))[WARMUP_STEPS:]
            rows.append({"repeat": rep, "strategy": strategy,
                         "median_step_s": statistics.median(times),
                         "mean_step_s": statistics.fmean(times), "steps_timed": len(times)})
            print(f"  repeat {rep} {strategy:>10}: median {rows[-1]['median_step_s'] * 1000:.1f} "
                  f"ms/step", flush=True)
    med = {s: statistics.median(r["median_step_s"] for r in rows if r["strategy"] == s)
           for s in names}
    ratios, record_ratios, commit_ratios, job_ratios = [], [], [], []
    for rep in range(repeats):
        by = {r["strategy"]: r["median_step_s"] for r in rows if r["repeat"] == rep}
        ratios.append(by["trainmover"] / by["ddp"])
        job_ratios.append(by[JOB] / by["ddp"])
        record_ratios.append(by["trainmover_recorded"] / by["trainmover"])
        commit_ratios.append(by["trainmover"] / by["trainmover_no_commit"])
    result = {
        "benchmark": "step", "recipe": recipe, "layout": cfg.layout.as_dict(),
        "model_params": cfg.model.num_params(), "global_batch": cfg.train.global_batch,
        "num_microbatches": cfg.train.num_microbatches, "steps": steps,
        "warmup_steps_excluded": WARMUP_STEPS, "threads_per_worker": cfg.threads_per_worker(),
        "rows": rows, "median_step_s": med,
        "overhead_vs_ddp": statistics.median(ratios) - 1.0,
        "per_repeat_ratio": ratios,
        "job_overhead_vs_ddp": statistics.median(job_ratios) - 1.0,
        "per_repeat_job_ratio": job_ratios,
        "commit": git_commit(),
        "recorded_over_plain": statistics.median(record_ratios),
        "commit_over_no_commit": statistics.median(commit_ratios),
        "per_repeat_commit_over_no_commit": commit_ratios,
        "per_repeat_recorded_over_plain": record_ratios, "machine": machine_description(),
    }
    write_result(out_dir, "step", result, _step_table(result))
    return result




def _verdict(ratios: list[float]) -> str:
    """A ratio whose repeats straddle 1 is no measurable difference."""
    lo, hi = min(ratios), max(ratios)
    mid = statistics.median(ratios)
    if lo <= 1.0 <= hi:
        return f"no measurable difference (median {mid:.3f}, repeats {lo:.3f}-{hi:.3f})"
    return f"{(mid - 1) * 100:+.1f}% (repeats {lo:.3f}-{hi:.3f})"


def _step_table(r: dict) -> str:
    lines = [f"# bench step: the built-in trainer vs DistributedDataParallel ({r['recipe']}, "
             f"DP{r['layout']['dp']}, {r['model_params'] / 1e6:.2f}M params, "
             f"{r['threads_per_worker']} thread(s) per worker, commit {r.get('commit')})", "",
             "Strategies: `trainmover_job` = a whole job as `trainmover run` runs it (the "
             "runtime API's step loop, commit vote, heartbeats, metrics; step time commit to "
             "commit); `trainmover` = the engine's step with the commit vote and abortable "
             "waits in a bare process; `_recorded` = the same after recording step 0 for "
             "warm-up; `_no_commit` = without vote and abortable waits; `ddp` = the reference "
             "DDP loop.", "",
             "| strategy | median step (ms) |", "|---|---|"]
    for s, v in r["median_step_s"].items():
        lines.append(f"| {s} | {v * 1000:.1f} |")
    lines += ["",
              f"job (runtime API) vs DDP: {_verdict(r['per_repeat_job_ratio'])}",
              f"engine step vs DDP: {_verdict(r['per_repeat_ratio'])}",
              f"steady state after recording step 0 for warm-up, over plain: "
              f"{_verdict(r['per_repeat_recorded_over_plain'])}",
              f"commit vote + abortable waits, over none: "
              f"{_verdict(r['per_repeat_commit_over_no_commit'])}",
              f"{len(r['per_repeat_ratio'])} interleaved repeats, first "
              f"{r['warmup_steps_excluded']} steps excluded; machine: {r['machine']['cpu']}, "
              f"{r['machine']['cores']} cores, torch {r['machine']['torch']}"]
    return "\n".join(lines) + "\n"






# --- bench downtime --------------------------------------------------------------------------

def main(args) -> int:
    if args.bench == "step":
        bench_step(args.recipe, args.dp, args.steps, args.repeats, args.out)
        return 0
    if args.bench == "example":
        from trainmover.bench.example import bench_example

        bench_example(args.nproc, args.steps, args.repeats, args.out, script=args.script)
        return 0
    if args.bench == "example-downtime":
        from trainmover.bench.example_downtime import bench_example_downtime

        bench_example_downtime(args.repeats, args.steps, args.event_step,
                               args.checkpoint_every, args.out)
        return 0
    if args.bench == "checkpoint":
        from trainmover.bench.checkpoint import bench_checkpoint

        intervals = [int(x) for x in args.intervals.split(",")]
        bench_checkpoint(intervals, args.steps, args.repeats, args.recipe, args.out)
        return 0
    if args.bench == "sources":
        from trainmover.bench.sources import bench_sources

        bench_sources(args.repeats, args.steps, args.every, args.crash_step, args.recipe,
                      args.out)
        return 0
    if args.bench == "false-positives":
        from trainmover.bench.falsepos import bench_false_positives

        result = bench_false_positives(args.runs, args.steps, args.recipe, args.out)
        return 0 if result["false_positives"] == 0 else 1
    if args.bench == "ettr":
        from trainmover.bench.ettr import bench_ettr

        bench_ettr(args.minutes, args.every, args.repeats, args.recipe, args.out, args.json,
                   standbys=args.standbys, replenish=not args.no_replenish, name=args.name)
        return 0
    if args.bench == "straggler":
        from trainmover.bench.stragglers import bench_straggler

        bench_straggler(args.steps, args.onset, args.factor, args.repeats, args.every,
                        args.recipe, args.out, args.json)
        return 0
    if args.bench == "view":
        from trainmover.bench.view import bench_view

        bench_view(args.steps, args.repeats, args.recipe, args.out)
        return 0
    if args.bench == "control":
        from trainmover.bench.control import bench_control, parse_sizes

        bench_control(parse_sizes(args.workers), args.repeats, args.compute_s, WARMUP_STEPS,
                      args.steady, WARMUP_STEPS, args.standbys, args.timeout_s, args.out,
                      args.name, keep=args.keep, full_hosts=args.full_hosts or None,
                      overrides=args.overrides, sim_procs=args.sim_procs)
        return 0
    if args.bench == "soak":
        from trainmover.bench.soak import bench_soak

        result = bench_soak(args.minutes, args.interval, args.seed, args.out)
        return 0 if result["passed"] else 1
    if args.bench == "hosts":
        from trainmover.bench.hosts import bench_hosts
        from trainmover.bench.netns import available

        why_not = available()
        if why_not:
            raise ValueError(f"bench hosts needs network namespaces: {why_not}")
        bench_hosts(args.repeats, args.out)
        return 0
    if args.bench == "torchft":
        from trainmover.bench.torchft_side import bench_torchft

        bench_torchft(args.replicas, args.recipe, args.repeats, args.kill_after,
                      args.steps_after, args.out)
        return 0
    if args.bench == "downtime":
        from trainmover.bench.downtime import SCENARIOS, STRATEGIES, bench_downtime

        workers = [int(x) for x in args.workers.split(",")]
        strategies = args.strategies.split(",")
        for s in strategies:
            if s not in STRATEGIES:
                raise ValueError(f"--strategies: unknown strategy {s!r} "
                                 f"(known: {', '.join(STRATEGIES)})")
        scenarios = args.scenarios.split(",")
        for s in scenarios:
            if s not in SCENARIOS:
                raise ValueError(f"--scenarios: unknown scenario {s!r} "
                                 f"(known: {', '.join(SCENARIOS)})")
        command = (f"trainmover bench downtime --workers {args.workers} --strategies "
                   f"{args.strategies} --scenarios {args.scenarios} --name {args.name}"
                   + (" --no-compile" if args.no_compile else "") +
                   f" --event-step {args.event_step} --repeats {args.repeats} "
                   f"--compile-up-to {args.compile_up_to} --out {args.out}")
        bench_downtime(workers, not args.no_compile, args.event_step, args.out, args.json,
                       strategies, scenarios=scenarios, name=args.name, repeats=args.repeats,
                       compile_up_to=args.compile_up_to, command=command)
        return 0
    if args.bench == "quick":
        from trainmover.bench.downtime import LAYOUTS_BY_WORKERS
        from trainmover.bench.quick import bench_quick

        if args.workers not in LAYOUTS_BY_WORKERS:
            raise ValueError(f"--workers {args.workers}: choose from "
                             f"{sorted(LAYOUTS_BY_WORKERS)}")
        if args.repeats < 1:
            raise ValueError(f"--repeats {args.repeats}: must be >= 1")
        # the command as given, every setting spelled out (the file says how to redo it)
        command = (f"trainmover bench quick --workers {args.workers} --repeats "
                   f"{args.repeats} --event-step {args.event_step} --name {args.name} "
                   f"--out {args.out}")
        bench_quick(args.workers, args.repeats, args.event_step, args.out, args.name,
                    command)
        return 0
    if args.bench == "state-size":
        from trainmover.bench.state_size import SCENARIOS, STRATEGIES, bench_state_size

        try:
            sizes = [float(x) for x in args.sizes.split(",")]
        except ValueError:
            raise ValueError(f"--sizes {args.sizes!r}: a comma list of numbers (MB)") from None
        scenarios = args.scenarios.split(",")
        for s in scenarios:
            if s not in SCENARIOS:
                raise ValueError(f"--scenarios: unknown scenario {s!r} "
                                 f"(known: {', '.join(SCENARIOS)})")
        strategies = args.strategies.split(",")
        for s in strategies:
            if s not in STRATEGIES:
                raise ValueError(f"--strategies: unknown strategy {s!r} "
                                 f"(known: {', '.join(STRATEGIES)})")
        if args.repeats < 1:
            raise ValueError(f"--repeats {args.repeats}: must be >= 1")
        command = (f"trainmover bench state-size --sizes {args.sizes} --repeats "
                   f"{args.repeats} --scenarios {args.scenarios} --strategies "
                   f"{args.strategies} --name {args.name} --out {args.out}")
        bench_state_size(sizes, args.repeats, scenarios, args.out, args.name, command,
                         strategies=strategies)
        return 0
    if args.bench == "transfer":
        from trainmover.bench.transfer import bench_transfer

        try:
            sizes = [float(x) for x in args.sizes.split(",")]
        except ValueError:
            raise ValueError(f"--sizes {args.sizes!r}: a comma list of numbers (MB)") from None
        command = (f"trainmover bench transfer --sizes {args.sizes} --repeats {args.repeats} "
                   f"--name {args.name} --out {args.out}")
        bench_transfer(sizes, args.repeats, args.out, args.name, command)
        return 0
    raise ValueError(f"unknown benchmark {args.bench!r}")
