"""Runs a plain torchrun training script (no trainmover in it) and, when its main() returns,
writes rank 0's final model and optimizer state digest in trainmover's canonical form
(``weights_sha256``), so a test can compare the same script under torchrun and under
trainmover. It finds the script's DDP module and optimizer by wrapping their constructors.

    torchrun --nproc-per-node 2 tests/data/torchrun_weights.py OUT SCRIPT [ARGS]
"""
import json
import runpy
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from trainmover.core.topology import Layout, Role
from trainmover.train.state import TrainState, assemble, state_digest

seen = {}


def _capture(cls, key):
    original = cls.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        seen.setdefault(key, self)

    cls.__init__ = init


def main():
    out, script, *args = sys.argv[1:]
    torch.set_num_threads(1)     # as `trainmover launch --threads 1`
    _capture(DistributedDataParallel, "model")
    _capture(torch.optim.Optimizer, "optimizer")
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")
    if dist.get_rank() == 0:
        entries = TrainState(seen["model"], seen["optimizer"]).entries()
        canonical = assemble({Role(0, 0, 0): entries}, Layout(1, 1, 1))
        with open(out, "w") as f:
            json.dump({"weights_sha256": state_digest(canonical)}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
