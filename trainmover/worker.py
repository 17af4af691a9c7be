"""A worker process: holds one role, builds its groups, trains, reports.

Started by the coordinator as ``python -m trainmover.worker --run-dir DIR --name w3 --store
HOST:PORT``. Its role comes from the membership table in the store, not from its name.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

T_START = time.perf_counter()

import torch  # noqa: E402  (import time is measured)

from .comm import GroupBuilder, StoreAddress, StoreClients, build_comm_groups  # noqa: E402
from .config import JobConfig  # noqa: E402
from .data import BatchSource, load_tokens  # noqa: E402
from .engine import Engine  # noqa: E402
from .events import EventLog, JsonlWriter  # noqa: E402
from .state import local_state  # noqa: E402
from .topology import Role  # noqa: E402


def reporter_role(cfg: JobConfig) -> Role:
    """The role that writes metrics.jsonl: it holds the loss (last stage) and is unique."""
    return Role(0, cfg.layout.pp - 1, 0)


def save_atomic(obj, path: str) -> None:
    """Write then rename, so a reader never sees a partial file."""
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def run(run_dir: str, name: str, store_addr: StoreAddress) -> None:
    t_imported = time.perf_counter()
    with open(os.path.join(run_dir, "job.json")) as f:
        cfg = JobConfig.from_dict(json.load(f))
    torch.set_num_threads(cfg.threads_per_worker())
    stores = StoreClients(store_addr, timeout_s=cfg.runtime.group_timeout_s)
    store = stores.get()
    role = Role.parse(store.get(f"membership/worker/{name}").decode())
    events = EventLog(os.path.join(run_dir, "events.jsonl"), worker=name, role=role.name)
    events.emit("worker_started", pid=os.getpid(), import_s=round(t_imported - T_START, 4))

    device = torch.device(cfg.runtime.device)
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", cfg.layout.global_rank(role)))
                              % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    builder = GroupBuilder(stores, device, cfg.runtime.group_timeout_s)
    t0 = time.perf_counter()
    groups, build_times = build_comm_groups(builder, cfg.layout, role)
    events.emit("groups_built", generation=0, duration_s=round(time.perf_counter() - t0, 4),
                groups={k: round(v, 4) for k, v in build_times.items()})

    data = load_tokens(cfg.data)
    batches = BatchSource(data, cfg.model.seq_len, cfg.train.global_batch, cfg.train.seed,
                          cfg.model.vocab_size)
    engine = Engine(cfg, role, groups, batches, device)
    events.emit("engine_ready", setup_s=round(time.perf_counter() - t_imported, 4),
                params=sum(p.numel() for p in engine.params))

    metrics = JsonlWriter(os.path.join(run_dir, "metrics.jsonl")) \
        if role == reporter_role(cfg) else None
    tokens_per_step = cfg.train.global_batch * cfg.model.seq_len
    for step in range(cfg.train.steps):
        result = engine.train_step(step)
        if metrics is not None:
            metrics.write({"step": step, "loss": result.loss,
                           "step_time_s": round(result.step_time_s, 6),
                           "tokens_per_s": round(tokens_per_step / result.step_time_s, 1),
                           "lr": result.lr, "grad_norm": result.grad_norm, "worker": name})

    if role.dp == 0:
        shard_dir = os.path.join(run_dir, "final", "shards")
        os.makedirs(shard_dir, exist_ok=True)
        tensors, dims = local_state(engine.model, engine.optimizer)
        save_atomic({"tensors": {k: v.cpu() for k, v in tensors.items()}, "dims": dims},
                    os.path.join(shard_dir, f"{role.name}.pt"))
    events.emit("worker_done", steps=cfg.train.steps)
    groups.shutdown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="trainmover.worker")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--store", required=True, type=StoreAddress.parse)
    args = p.parse_args(argv)
    run(args.run_dir, args.name, args.store)
    return 0


if __name__ == "__main__":
    sys.exit(main())
