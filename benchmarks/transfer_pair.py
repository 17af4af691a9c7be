"""A leaver's state transfer against a plain gloo pair, outside a job: two processes, a
TrainState of about SIZE_MB (Linear(WIDTH, WIDTH) blocks, 1024 unless given, AdamW stepped once), sent with
``send_state``/``recv_state`` over the migration's channel, then the same bytes as one warm
buffer over the same channel.

    python benchmarks/transfer_pair.py SIZE_MB [BUCKET_MB] [REPEATS] [WIDTH]

Prints each repeat's seconds for both; it is a probe for profiling (run the transfer under
``py-spy``), not a benchmark result: ``trainmover bench state-size`` measures migrations."""
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import torch  # noqa: E402
from torch import nn  # noqa: E402

from mp_harness import run_processes, values  # noqa: E402



def mb_per_block(width: int) -> float:
    """fp32 weight and bias of Linear(width, width) and AdamW's two moments."""
    return 12 * (width * width + width) / 2**20


def _side(rank, address, size_mb, bucket_mb, repeats, width):
    from trainmover.comm.groups import (AbortSignal, GroupBuilder, StoreClients,
                                        build_comm_groups)
    from trainmover.core.topology import GroupSpec, Layout, Role
    from trainmover.train.buckets import GradBuckets
    from trainmover.train.state import TrainState
    from trainmover.train.transfer import recv_state, send_state

    builder = GroupBuilder(StoreClients(address), torch.device("cpu"), 60,
                           abort_signal=AbortSignal())
    channel = builder.build_ranked(GroupSpec("xfer.t", "xfer", (Role(0, 0, 0),) * 2), rank, 0,
                                   abortable=False)
    torch.manual_seed(rank)
    blocks = max(1, round(size_mb / mb_per_block(width)))
    net = nn.Sequential(*[nn.Linear(width, width) for _ in range(blocks)])
    opt = torch.optim.AdamW(net.parameters())
    net(torch.randn(2, width)).sum().backward()
    opt.step()
    opt.zero_grad()
    groups = build_comm_groups(builder, Layout(), Role(0, 0, 0))[0]
    buckets = GradBuckets(list(net.parameters()), int(bucket_mb * 2**20), groups) \
        if bucket_mb else None
    state = TrainState(net, opt, buckets=buckets)
    out, plain = {"transfer_s": [], "plain_s": []}, None

    def sync():
        (channel.send(torch.ones(1), 1) if rank == 0 else channel.recv(torch.ones(1), 0)).wait()

    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        info = send_state(state, channel, 1, 5) if rank == 0 else recv_state(state, channel, 0)[1]
        out["transfer_s"].append(time.perf_counter() - t0)
        if plain is None:
            plain = torch.zeros(info["bytes"] // 4)     # touched once, reused: a warm buffer
        sync()
        t0 = time.perf_counter()
        (channel.send(plain, 1) if rank == 0 else channel.recv(plain, 0)).wait()
        out["plain_s"].append(time.perf_counter() - t0)
    out["bytes"] = info["bytes"]
    return out


if __name__ == "__main__":
    size = float(sys.argv[1])
    bucket = float(sys.argv[2]) if len(sys.argv) > 2 else 25.0
    repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    width = int(sys.argv[4]) if len(sys.argv) > 4 else 1024
    res = values(run_processes(_side, 2, size, bucket, repeats, width, timeout=600))[1]
    print(f"{res['bytes'] / 1e6:.1f} MB: transfer "
          f"{[round(t, 3) for t in res['transfer_s']]} s, one warm buffer "
          f"{[round(t, 3) for t in res['plain_s']]} s")
