"""The job's final state: each data-parallel-rank-0 role writes its local state, and the
holder of role dp0.pp0.tp0 assembles the canonical state from them, hashes it and writes the
final checkpoint. Done by a worker, not the controller: the controller never touches tensors.

Files: ``final/shards/<role>.pt`` (temporary), ``final/checkpoint/`` (DCP, the canonical
state), ``final/digest.json`` (``weights_sha256`` and where the checkpoint is).
"""
from __future__ import annotations

import json
import os
import shutil
import time

import torch

from trainmover.core import protocol as P
from trainmover.core.files import DIGEST_FILE, final_dir
from trainmover.core.topology import Layout, Role
from trainmover.train.checkpoint import save_canonical
from trainmover.train.state import TrainState, assemble, state_digest

# How often the assembler counts the final shards written (a wait of about a step, once per
# job: polling it costs nothing).
SHARD_POLL_S = 0.01


def save_atomic(obj, path: str) -> None:
    """Write then rename, so a reader never sees a partial file."""
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def write_final_shard(run_dir: str, role: Role, state: TrainState, store, layout: Layout,
                      timeout_s: float) -> None:
    shard_dir = os.path.join(final_dir(run_dir), "shards")
    os.makedirs(shard_dir, exist_ok=True)
    tensors, dims = state.local_state()
    save_atomic({"tensors": {k: v.detach().cpu() for k, v in tensors.items()}, "dims": dims,
                 "dp_dims": state.dp_dims(), "boxes": state.boxes()},
                os.path.join(shard_dir, f"{role.name}.pt"))
    store.add(P.final_shards_key(), 1)
    if role != Role(0, 0, 0):
        return
    expected = sum(1 for r in layout.roles() if layout.holds_final_share(r))
    deadline = time.monotonic() + timeout_s
    while store.add(P.final_shards_key(), 0) < expected:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {store.add(P.final_shards_key(), 0)}/{expected} final "
                               f"shards were written within {timeout_s} s")
        time.sleep(SHARD_POLL_S)
    assemble_final(run_dir, layout)


def assemble_final(run_dir: str, layout: Layout) -> dict:
    shard_dir = os.path.join(final_dir(run_dir), "shards")
    shards = {}
    for role in layout.roles():
        if layout.holds_final_share(role):
            blob = torch.load(os.path.join(shard_dir, f"{role.name}.pt"), weights_only=True)
            shards[role] = (blob["tensors"], blob["dims"], blob.get("dp_dims", {}),
                            blob.get("boxes", {}))
    canonical = assemble(shards, layout)
    ckpt_dir = os.path.join(final_dir(run_dir), "checkpoint")
    save_canonical(canonical, ckpt_dir)
    out = {"weights_sha256": state_digest(canonical), "checkpoint": ckpt_dir,
           "tensors": len(canonical)}
    tmp = os.path.join(final_dir(run_dir), DIGEST_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(out, f)
    os.replace(tmp, os.path.join(final_dir(run_dir), DIGEST_FILE))
    shutil.rmtree(shard_dir, ignore_errors=True)
    return out
