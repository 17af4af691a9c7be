"""The GPT of `ddp_gpt_plain.py` in two dimensions (the torchtitan layout): tensor parallel
inside each block (`parallelize_module`: attention heads and the MLP's hidden units split
column-wise, the output projections row-wise) over the mesh's "tp" dimension, and FSDP2
(`fully_shard` per block and at the root) over its "dp" dimension: the plain torchrun
script. `torch_fsdp_tp.py` is the same script made resilient with trainmover: diff the two.

    torchrun --nproc-per-node 4 examples/torch_fsdp_tp_plain.py --tp 2
    trainmover launch --dp 2 --tp 2 --dp-sharded --standbys 1 -- \
        python examples/torch_fsdp_tp.py --tp 2
"""
import argparse
import math
import os
import sysconfig
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               parallelize_module)


class Block(nn.Module):
    """q, k and v are separate projections so that a column-wise split gives each
    tensor-parallel rank whole heads (a split of one fused qkv would mix q with k)."""

    def __init__(self, d_model, n_head):
        super().__init__()
        self.head_dim = d_model // n_head
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.q, self.k, self.v = (nn.Linear(d_model, d_model) for _ in range(3))
        self.proj = nn.Linear(d_model, d_model)
        self.fc1, self.fc2 = nn.Linear(d_model, 4 * d_model), nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.ln1(x)
        # -1: the heads this rank holds (all of them without tensor parallelism)
        q, k, v = (lin(h).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, -1))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


TP_PLAN = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
           "proj": RowwiseParallel(), "fc1": ColwiseParallel(), "fc2": RowwiseParallel()}


class GPT(nn.Module):
    def __init__(self, vocab, block_size, n_layer, d_model, n_head):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(block_size, d_model)
        self.blocks = nn.ModuleList([Block(d_model, n_head) for _ in range(n_layer)])
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def load_corpus(max_bytes=2_000_000):
    """The standard library's sources as bytes: every Python install has them."""
    root, chunks, total = sysconfig.get_paths()["stdlib"], [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "test"))
        for name in sorted(f for f in filenames if f.endswith(".py")):
            with open(os.path.join(dirpath, name), "rb") as f:
                chunks.append(f.read())
            total += len(chunks[-1])
            if total >= max_bytes:
                return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8)
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


def get_batch(data, step, rank, world, batch_size, block_size, seed):
    """The batch of a step is a function of the step alone: positions drawn from a generator
    seeded by (seed, step); each rank takes its slice of the global batch."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    ix = torch.randint(len(data) - block_size - 1, (batch_size,), generator=g)
    per = batch_size // world
    ix = ix[rank * per:(rank + 1) * per]
    x = torch.stack([data[i:i + block_size] for i in ix]).long()
    y = torch.stack([data[i + 1:i + 1 + block_size] for i in ix]).long()
    return x, y


def clip_grad_norm(model, max_norm):
    """torch.nn.utils.clip_grad_norm_ for parameters on two meshes: the tensor-parallel ones
    live on the 2-D (dp, tp) mesh, the rest on its dp dimension, and torch's version mixes
    the two in one operation, which DTensor refuses. So: one total norm per mesh (one
    reduction each), the norm of those, and the scaling done mesh by mesh."""
    params = {}
    for p in model.parameters():
        if p.grad is not None:
            params.setdefault(p.grad.device_mesh, []).append(p)
    norms = [torch.nn.utils.get_total_norm([p.grad for p in ps]).full_tensor()
             for ps in params.values()]
    total = torch.linalg.vector_norm(torch.stack(norms))
    for ps in params.values():
        torch.nn.utils.clip_grads_with_norm_(ps, max_norm, total)


def lr_at(step, steps, lr, warmup):
    if step < warmup:
        return lr * (step + 1) / warmup
    return 0.1 * lr + 0.45 * lr * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--save", default="", help="a folder: the final model and optimizer "
                   "state in torch.distributed.checkpoint (DCP) format")
    args = p.parse_args()
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    torch.manual_seed(args.seed)
    model = GPT(256, args.block_size, args.n_layer, args.d_model, args.n_head)
    mesh = init_device_mesh("cpu", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], TP_PLAN)
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    # the batch is split over dp only: the tensor-parallel ranks of a dp rank share it
    rank, world = mesh["dp"].get_local_rank(), mesh["dp"].size()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    data = load_corpus()
    t_prev = time.perf_counter()
    for step in range(args.steps):
        x, y = get_batch(data, step, rank, world, args.batch_size, args.block_size, args.seed)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, warmup=5)
        loss = model(x, y)
        loss.backward()
        clip_grad_norm(model, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t_now = time.perf_counter()   # step to step, everything in between included
        if dist.get_rank() == 0:
            print(f"step {step} loss {loss.item():.4f} {1000 * (t_now - t_prev):.1f} ms",
                  flush=True)
        t_prev = t_now
    if args.save:   # collective on the default group: every rank writes its own shards
        model_state, optim_state = get_state_dict(model, opt)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=args.save)


if __name__ == "__main__":
    main()
