"""Benchmarks. Results go under ``benchmarks/results/``; each compares strategies measured side
by side in one run (interleaved repeats), because this machine is shared and noisy.

``bench step``: the engine's training step in a DP-only layout against plain
``DistributedDataParallel`` over gloo: same model code, batch, micro-batches, optimizer,
clipping and processes. Only the step loop differs.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import platform
import queue
import signal
import statistics
import time

import torch

from .comm import GroupBuilder, StoreAddress, StoreClients, build_comm_groups, start_store_server
from .config import JobConfig
from .data import BatchSource, load_tokens
from .engine import Engine, lr_at
from .recipes import get_recipe
from .topology import Layout, Role

WARMUP_STEPS = 5


def machine_description() -> dict:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version(), "platform": platform.platform()}


def _engine_steps(cfg: JobConfig, rank: int, address: StoreAddress) -> list[float]:
    role = cfg.layout.role_of(rank)
    builder = GroupBuilder(StoreClients(address), torch.device("cpu"), 120)
    groups, _ = build_comm_groups(builder, cfg.layout, role)
    data = load_tokens(cfg.data)
    batches = BatchSource(data, cfg.model.seq_len, cfg.train.global_batch, cfg.train.seed,
                          cfg.model.vocab_size)
    engine = Engine(cfg, role, groups, batches, torch.device("cpu"))
    times = [engine.train_step(step).step_time_s for step in range(cfg.train.steps)]
    groups.shutdown()
    return times


def _ddp_steps(cfg: JobConfig, rank: int, address: StoreAddress) -> list[float]:
    """The reference loop a DDP user writes: no_sync for all but the last micro-batch,
    clip_grad_norm_, AdamW, and the loss averaged over replicas for logging."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from .model import GPTStage

    store = dist.TCPStore(address.host, address.port, is_master=False)
    dist.init_process_group("gloo", store=dist.PrefixStore("ddp/", store), rank=rank,
                            world_size=cfg.layout.dp)
    local = Layout()
    builder = GroupBuilder(StoreClients(address), torch.device("cpu"), 120)
    groups, _ = build_comm_groups(builder, local, Role(0, 0, 0))  # trivial: no TP traffic
    model = GPTStage(cfg.model, local, 0, 0, groups)
    model.init_weights(cfg.train.seed)
    ddp = DDP(model, bucket_cap_mb=cfg.train.bucket_mb)
    tc = cfg.train
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": tc.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=tc.lr, betas=(tc.beta1, tc.beta2), eps=tc.eps, foreach=False)
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
    dist.destroy_process_group()
    return times


_STRATEGIES = {"trainmover": _engine_steps, "ddp": _ddp_steps}


def _child(strategy: str, cfg_dict: dict, rank: int, address: StoreAddress, threads: int,
           out: mp.Queue) -> None:
    torch.set_num_threads(threads)
    cfg = JobConfig.from_dict(cfg_dict)
    out.put((rank, _STRATEGIES[strategy](cfg, rank, address)))


def run_strategy(strategy: str, cfg: JobConfig, timeout_s: float = 600) -> list[float]:
    """Per-step times of rank 0, from fresh processes."""
    ctx = mp.get_context("spawn")
    store = start_store_server()
    address = StoreAddress("127.0.0.1", store.port)
    out = ctx.Queue()
    threads = cfg.threads_per_worker()
    procs = [ctx.Process(target=_child, args=(strategy, cfg.to_dict(), r, address, threads, out))
             for r in range(cfg.layout.num_roles)]
    for p in procs:
        p.start()
    results = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < len(procs):
            if time.monotonic() > deadline:
                raise RuntimeError(f"bench strategy {strategy} exceeded {timeout_s} s")
            try:
                rank, times = out.get(timeout=1.0)
                results[rank] = times
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"bench strategy {strategy}: a process exited with "
                                       f"code {dead[0].exitcode}")
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
                p.join()
    return results[0]


def bench_step(recipe: str = "bench_step", dp: int = 2, steps: int = 30, repeats: int = 3,
               out_dir: str = "benchmarks/results") -> dict:
    cfg = get_recipe(recipe)
    cfg.layout = Layout(dp, 1, 1)
    cfg.train.steps = steps
    cfg.validate()
    if steps <= WARMUP_STEPS + 2:
        raise ValueError(f"--steps must exceed {WARMUP_STEPS + 2}, got {steps}")
    rows = []
    for rep in range(repeats):
        # interleave: a slow phase of the shared machine hits both strategies alike
        for strategy in ("trainmover", "ddp") if rep % 2 == 0 else ("ddp", "trainmover"):
            times = run_strategy(strategy, cfg)[WARMUP_STEPS:]
            rows.append({"repeat": rep, "strategy": strategy,
                         "median_step_s": statistics.median(times),
                         "mean_step_s": statistics.fmean(times), "steps_timed": len(times)})
            print(f"  repeat {rep} {strategy:>10}: median {rows[-1]['median_step_s'] * 1000:.1f} "
                  f"ms/step", flush=True)
    med = {s: statistics.median(r["median_step_s"] for r in rows if r["strategy"] == s)
           for s in ("trainmover", "ddp")}
    ratios = []
    for rep in range(repeats):
        by = {r["strategy"]: r["median_step_s"] for r in rows if r["repeat"] == rep}
        ratios.append(by["trainmover"] / by["ddp"])
    result = {
        "benchmark": "step", "recipe": recipe, "layout": cfg.layout.as_dict(),
        "model_params": cfg.model.num_params(), "global_batch": cfg.train.global_batch,
        "num_microbatches": cfg.train.num_microbatches, "steps": steps,
        "warmup_steps_excluded": WARMUP_STEPS, "threads_per_worker": cfg.threads_per_worker(),
        "rows": rows, "median_step_s": med,
        "overhead_vs_ddp": statistics.median(ratios) - 1.0,
        "per_repeat_ratio": ratios, "machine": machine_description(),
    }
    _write(out_dir, "step", result, _step_table(result))
    return result


def _step_table(r: dict) -> str:
    lines = [f"# bench step: engine vs DistributedDataParallel ({r['recipe']}, "
             f"DP{r['layout']['dp']}, {r['model_params'] / 1e6:.2f}M params)", "",
             "| strategy | median step (ms) |", "|---|---|"]
    for s, v in r["median_step_s"].items():
        lines.append(f"| {s} | {v * 1000:.1f} |")
    lines += ["", f"overhead vs DDP (median of per-repeat ratios): "
              f"{r['overhead_vs_ddp'] * 100:+.1f}%",
              f"per-repeat ratios: {', '.join(f'{x:.3f}' for x in r['per_repeat_ratio'])}",
              f"machine: {r['machine']['cpu']}, {r['machine']['cores']} cores, "
              f"torch {r['machine']['torch']}"]
    return "\n".join(lines) + "\n"


def _write(out_dir: str, name: str, result: dict, table: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=2)
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(table)
    print(table)


def main(args) -> int:
    if args.bench == "step":
        bench_step(args.recipe, args.dp, args.steps, args.repeats, args.out)
        return 0
    raise ValueError(f"unknown benchmark {args.bench!r}")
