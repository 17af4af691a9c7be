"""The GPT of `ddp_gpt_plain.py` split into pipeline stages (`torch.distributed.pipelining`:
a `PipelineStage` per rank and a GPipe schedule over micro-batches), each stage fully
sharded with FSDP2 over the data-parallel replicas: a 2-D (dp, pp) device mesh, the
torchtitan layout without tensor parallelism. The plain torchrun script;
`torch_pipeline.py` is the same script made resilient with trainmover: diff the two.

    torchrun --nproc-per-node 4 examples/torch_pipeline_plain.py --pp 2
    trainmover launch --dp 2 --pp 2 --dp-sharded --standbys 1 -- \
        python examples/torch_pipeline.py --pp 2
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
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
import trainmover


class Block(nn.Module):
    def __init__(self, d_model, n_head):
        super().__init__()
        self.n_head = n_head
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.fc1, self.fc2 = nn.Linear(d_model, 4 * d_model), nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    """Blocks in a dict keyed by layer number, so that a stage that keeps some of them keeps
    their names: every parameter's name is the same on its stage as in the whole model."""

    def __init__(self, vocab, block_size, n_layer, d_model, n_head):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(block_size, d_model)
        self.blocks = nn.ModuleDict({str(i): Block(d_model, n_head) for i in range(n_layer)})
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, x):
        """Tokens in on the first stage, activations in and out between stages, logits out of
        the last."""
        if self.tok is not None:
            x = self.tok(x) + self.pos(torch.arange(x.shape[1]))
        for block in self.blocks.values():
            x = block(x)
        if self.head is not None:
            x = self.head(self.ln(x))
        return x


def keep_stage(model, stage, stages):
    """Cut the whole model (built, and so initialised, the same on every rank) down to
    pipeline stage ``stage`` of ``stages``: its share of the blocks, the embeddings on the
    first stage, the final norm and head on the last."""
    per = len(model.blocks) // stages
    for name in list(model.blocks):
        if not stage * per <= int(name) < (stage + 1) * per:
            del model.blocks[name]
    if stage != 0:
        model.tok = model.pos = None
    if stage != stages - 1:
        model.ln = model.head = None
    return model


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


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


def lr_at(step, steps, lr, warmup):
    if step < warmup:
        return lr * (step + 1) / warmup
    return 0.1 * lr + 0.45 * lr * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def clip_grad_norm(model, max_norm, pp_group):
    """torch.nn.utils.clip_grad_norm_ over the whole model: each stage's gradient norm (a
    reduction over its data-parallel shards), then the stages' norms combined over the
    pipeline group, so every stage scales by the same total."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads).full_tensor() ** 2
    dist.all_reduce(norm, group=pp_group)
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, norm.sqrt())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--pp", type=int, default=2)
    args = p.parse_args()
    rt = trainmover.init()
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // args.pp, args.pp), mesh_dim_names=("dp", "pp"))
    stage_index = mesh["pp"].get_local_rank()
    torch.manual_seed(args.seed)
    model = keep_stage(GPT(256, args.block_size, args.n_layer, args.d_model, args.n_head),
                       stage_index, args.pp)
    for block in model.blocks.values():
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    stage = PipelineStage(model, stage_index, args.pp, torch.device("cpu"),
                          group=mesh["pp"].get_group())
    schedule = ScheduleGPipe(stage, n_microbatches=args.microbatches, loss_fn=loss_fn)
    # the batch is split over dp only: the stages of a replica share it
    rank, world = mesh["dp"].get_local_rank(), mesh["dp"].size()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    rt.register(model=model, optimizer=opt)
    data = load_corpus()
    t_prev = time.perf_counter()
    for step in rt.steps(args.steps):
        x, y = get_batch(data, step, rank, world, args.batch_size, args.block_size, args.seed)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, warmup=5)
        losses = []
        schedule.step(*([x] if stage.is_first else []),
                      target=y if stage.is_last else None, losses=losses)
        loss = torch.stack(losses).mean().item() if losses else None   # the last stage's
        clip_grad_norm(model, 1.0, mesh["pp"].get_group())
        if rt.commit(loss=loss):
            opt.step()
        opt.zero_grad(set_to_none=True)
        t_now = time.perf_counter()   # step to step, everything in between included
        if loss is not None and rank == 0:
            print(f"step {step} loss {loss:.4f} {1000 * (t_now - t_prev):.1f} ms",
                  flush=True)
        t_prev = t_now


if __name__ == "__main__":
    main()
