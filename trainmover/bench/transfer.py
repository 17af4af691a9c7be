"""``trainmover bench transfer``: how close the state transfer of a planned migration (and of
a recovery from a replica) comes to the link it runs on, outside a job.

For each size (``--sizes``, MB of state per worker, as ``bench state-size`` sizes its models:
the built-in trainer's model, fp32 parameters and AdamW's two moments) two processes each
build that model and its optimizer as the trainer does (AdamW with its two parameter groups,
stepped once so that its moments exist), and then, ``--repeats`` times each, in the same
processes over the same gloo pair (the migration's kind of channel):

- ``transfer``: as a planned migration's switch, after its phase 1 (untimed: the leaver's
  ``post_layout`` and the joiner's ``recv_layout``, where each side takes its state's view),
  the leaver's ``send_state`` and the joiner's ``recv_state`` (the whole state, its metadata
  and the generators' states), timed on the sender from its call to a one-byte
  acknowledgement the receiver sends once its ``recv_state`` returned;
- ``view taken inside``: the same with nothing before it, as a recovery from a replica (each
  side's state view built inside the transfer);
- ``one buffer``: the same bytes as one warm buffer, then the same acknowledgement: the
  link's own time (``bench state-size``'s point-to-point figure).

Each repeat's efficiency is its one-buffer time over its transfer time: the fraction of the
link's bandwidth the transfer reaches. Inside a job the transfer also shares the cores with
the stayers and the standby's other work; ``bench state-size`` reports that figure
(``transfer_s``) beside its own point-to-point time.
"""
from __future__ import annotations

import os
import statistics
import time

from trainmover.bench.report import (fmt_spread, git_commit, machine_description, spread,
                                     write_result)

SIZES_MB = (100, 500, 2000)
# each process holds the state, its receive side another copy's worth in the optimizer's
# fresh moments, and the one buffer of the state's bytes: about 3 copies, 2 processes
COPIES_PER_SIZE = 6


def _state(model_cfg, builder, device):
    """The built-in trainer's state for one whole model (a DP worker's): GPTStage, its AdamW
    (``engine.adamw``), stepped once on zero gradients (its moments exist, zero)."""
    import torch

    from trainmover.comm.groups import build_comm_groups
    from trainmover.core.config import TrainConfig
    from trainmover.core.topology import Layout, Role
    from trainmover.train.engine import adamw
    from trainmover.train.model import GPTStage
    from trainmover.train.state import TrainState

    layout = Layout()
    groups, _ = build_comm_groups(builder, layout, Role(0, 0, 0))   # trivial: no TP traffic
    model = GPTStage(model_cfg, layout, 0, 0, groups).to(device)
    model.init_weights(0)
    params = list(model.parameters())
    opt = adamw(params, TrainConfig())
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return TrainState(model, opt)


def _pair_child(rank: int, address, model: dict, repeats: int, out) -> None:
    import torch

    from trainmover.comm.groups import GroupBuilder, StoreClients
    from trainmover.core.config import ModelConfig
    from trainmover.core.topology import GroupSpec, Role
    from trainmover.train.transfer import post_layout, recv_layout, recv_state, send_state

    torch.set_num_threads(1)
    device = torch.device("cpu")
    builder = GroupBuilder(StoreClients(address), device, 120.0)
    group = builder.build_ranked(GroupSpec("transfer", "xfer", (Role(0, 0, 0),) * 2), rank, 0)
    state = _state(ModelConfig(**model), builder, device)
    ack = torch.zeros(1, dtype=torch.uint8)

    def acknowledged(fn) -> tuple[float, object]:
        t0 = time.perf_counter()
        got = fn()
        if rank == 0:
            group.recv(ack, 1).wait()
        else:
            group.send(ack, 0).wait()
        return time.perf_counter() - t0, got

    def transfer(phase_1: bool) -> tuple[float, dict]:
        if phase_1:
            # untimed, as in a planned migration before its switch: the leaver posts its
            # layout, the joiner takes it (each side's state view is taken there)
            if rank == 0:
                for work, _ in post_layout(state, group, 1):
                    work.wait()
            else:
                recv_layout(state, group, 0)
        else:
            state.release_view()    # as a replica recovery: the view taken inside
        return acknowledged((lambda: send_state(state, group, 1, 7)) if rank == 0
                            else (lambda: recv_state(state, group, 0)[1]))

    result = {"transfer_s": [], "cold_s": [], "one_buffer_s": [],
              "tensors": len(state.entries()[0])}
    buffer = None
    for i in range(repeats + 1):   # the first round connects and touches pages: not counted
        seconds, got = transfer(phase_1=True)
        cold, _ = transfer(phase_1=False)
        if buffer is None:
            result["bytes"] = got["bytes"]
            buffer = torch.ones(got["bytes"], dtype=torch.uint8)    # warm: touched once
        one, _ = acknowledged(
            (lambda: group.send(buffer, 1).wait()) if rank == 0
            else (lambda: group.recv(buffer, 0).wait()))
        if i > 0:
            result["transfer_s"].append(seconds)
            result["cold_s"].append(cold)
            result["one_buffer_s"].append(one)
    out.put((rank, result))
    out.close()
    out.join_thread()
    os._exit(0)   # no group teardown (a destructor can wait on its peer's socket)


def measure_pair(model: dict, repeats: int, timeout_s: float = 900.0) -> dict:
    """One size: the sender's figures (``_pair_child``)."""
    from trainmover.bench.children import run_pair

    return run_pair(_pair_child, (model, repeats), "the transfer measurement", timeout_s)[0]


def bench_transfer(sizes: list[float], repeats: int, out_dir: str, name: str,
                   command: str) -> dict:
    from trainmover.bench.state_size import memory_available, size_info, size_model

    if repeats < 3:
        raise ValueError(f"--repeats {repeats}: at least 3 (a median with its min and max)")
    infos = [size_info(s) for s in sizes]      # refuses a bad size before anything runs
    rows, t_start = [], time.monotonic()
    for size_mb, info in zip(sizes, infos):
        need, have = COPIES_PER_SIZE * info["predicted_state_bytes"], memory_available()
        if have is not None and need > have:
            rows.append({"size_mb": size_mb, "not_run": f"needs about {need / 2**30:.1f} GiB, "
                                                        f"{have / 2**30:.1f} GiB available"})
            break
        model = size_model(size_mb)
        got = measure_pair({k: getattr(model, k) for k in info["model"]}, repeats)
        ratios = [o / t for o, t in zip(got["one_buffer_s"], got["transfer_s"])]
        cold_ratios = [o / t for o, t in zip(got["one_buffer_s"], got["cold_s"])]
        rows.append({"size_mb": size_mb, "model": info["model"], "params": info["params"],
                     "state_bytes": got["bytes"], "tensors": got["tensors"],
                     "transfer_s": spread(got["transfer_s"]),
                     "one_buffer_s": spread(got["one_buffer_s"]),
                     "efficiency": spread(ratios),
                     "cold_s": spread(got["cold_s"]), "cold_efficiency": spread(cold_ratios),
                     "transfer_gb_per_s": got["bytes"] / statistics.median(got["transfer_s"])
                     / 1e9,
                     "runs": got})
        print(f"{size_mb:g} MB: transfer {fmt_spread(rows[-1]['transfer_s'])} s, one buffer "
              f"{fmt_spread(rows[-1]['one_buffer_s'])} s, efficiency "
              f"{fmt_spread(rows[-1]['efficiency'], 2)} (view taken inside: "
              f"{fmt_spread(rows[-1]['cold_efficiency'], 2)})", flush=True)
    result = {"benchmark": "transfer", "sizes_mb": list(sizes), "repeats": repeats,
              "rows": rows, "command": command, "commit": git_commit(),
              "machine": machine_description(),
              "wall_s": round(time.monotonic() - t_start, 1)}
    write_result(out_dir, name, result, transfer_table(result))
    return result


def transfer_table(result: dict) -> str:
    m = result["machine"]
    lines = [f"# bench transfer: the state transfer against the link, outside a job "
             f"({result['repeats']} repeats, median (min-max))", "",
             f"command: `{result['command']}`; commit {result['commit']}; machine: "
             f"{m.get('cpu')}, {m.get('cores')} cores, torch {m.get('torch')}; took "
             f"{result['wall_s'] / 60:.1f} min", "",
             "| state (MB, measured) | model | transfer (s) | one buffer (s) | "
             "efficiency (one buffer / transfer) | transfer GB/s | view taken inside: "
             "transfer (s) | efficiency |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if "not_run" in r:
            lines.append(f"| {r['size_mb']:g} (not run: {r['not_run']}) | | | | | | | |")
            continue
        md = r["model"]
        cold = (f"{fmt_spread(r['cold_s'])} | {fmt_spread(r['cold_efficiency'], 2)}"
                if "cold_s" in r else "| ")
        lines.append(f"| {r['state_bytes'] / 1e6:.1f} | d{md['d_model']} x {md['n_layers']} "
                     f"({r['params'] / 1e6:.1f} M, {r['tensors']} tensors) | "
                     f"{fmt_spread(r['transfer_s'])} | "
                     f"{fmt_spread(r['one_buffer_s'])} | {fmt_spread(r['efficiency'], 2)} | "
                     f"{r['transfer_gb_per_s']:.2f} | {cold} |")
    lines += ["", "How to read it: two processes on this machine each build the built-in "
              "trainer's model of the size and its AdamW (moments present) and, in turn, "
              "send the whole state with `send_state`/`recv_state` (metadata, parameters, "
              "moments, generator states) and the same bytes as one warm buffer, over the "
              "same gloo pair; each timed on the sender up to a one-byte acknowledgement. "
              "`transfer`: as a planned migration's switch, after its phase 1 (untimed: "
              "`post_layout`/`recv_layout`, where each side takes its state's view); `view "
              "taken inside`: as a recovery from a replica, nothing before it. Efficiency: "
              "each repeat's one-buffer time over its transfer time. Inside a job the transfer "
              "shares the cores with the other workers: `bench state-size` reports that "
              "figure.", ""]
    return "\n".join(lines)
