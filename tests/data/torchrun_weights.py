"""Runs a plain torchrun training script (no trainmover in it) and, when its main() returns,
writes the final model and optimizer state digest in trainmover's canonical form
(``weights_sha256``: full tensors, sharded ones gathered, every pipeline stage's), so a test can compare the same
script under torchrun and under trainmover. It finds the script's model (its DDP module, or
the last module given to FSDP2's ``fully_shard``: the root) and optimizer by wrapping their
constructors.

    torchrun --nproc-per-node 2 tests/data/torchrun_weights.py OUT SCRIPT [ARGS]
"""
import functools
import json
import runpy
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import torch.distributed.fsdp as fsdp
from torch.distributed.tensor import DTensor

from trainmover.train.state import CANONICAL_PREFIXES, TrainState, state_digest

seen = {}


def _capture(cls, key):
    original = cls.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        seen.setdefault(key, self)

    cls.__init__ = init


def _capture_fully_shard():
    original = fsdp.fully_shard

    @functools.wraps(original)    # keeps its attributes: pipelining calls fully_shard.state
    def fully_shard(module, *args, **kwargs):
        out = original(module, *args, **kwargs)
        seen["model"] = module          # the last one is the root
        return out

    fsdp.fully_shard = fully_shard


def main():
    out, script, *args = sys.argv[1:]
    torch.set_num_threads(1)     # as `trainmover launch --threads 1`
    _capture(DistributedDataParallel, "model")
    _capture_fully_shard()
    _capture(torch.optim.Optimizer, "optimizer")
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")
    state = TrainState(seen["model"], seen["optimizer"])
    canonical = {}
    for name, t, _ in state._live():       # every rank: gathering a DTensor is collective
        if name.startswith(CANONICAL_PREFIXES):
            full = t.full_tensor() if isinstance(t, DTensor) else t
            canonical[name] = full.detach().cpu().clone()
    # every rank's share: pipeline stages hold different entries (names unique across
    # stages), data-parallel replicas the same ones
    shares = [None] * dist.get_world_size()
    dist.all_gather_object(shares, canonical)
    if dist.get_rank() == 0:
        merged = {}
        for share in shares:
            merged.update(share)
        with open(out, "w") as f:
            json.dump({"weights_sha256": state_digest(merged)}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
