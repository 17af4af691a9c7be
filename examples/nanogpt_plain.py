"""A nanoGPT-style training script as teams write them: DDP, dropout, gradient accumulation
through ``require_backward_grad_sync``, a GradScaler (AMP), a torchdata
``StatefulDataLoader`` with worker processes and prefetching, logging and checkpoints from
the master process only. The corpus is the Python standard library's own sources as bytes
(no download). ``nanogpt_plain.py`` is the script for plain torchrun, ``nanogpt.py`` the same
made resilient with trainmover (9 changed lines: docs/porting.md walks through them).

    torchrun --nproc-per-node 2 examples/nanogpt_plain.py
    trainmover launch --nproc 2 --standbys 1 -- python examples/nanogpt.py
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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader


class Block(nn.Module):
    def __init__(self, d_model, n_head, dropout):
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.fc1, self.fc2 = nn.Linear(d_model, 4 * d_model), nn.Linear(4 * d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class GPT(nn.Module):
    def __init__(self, vocab, block_size, n_layer, d_model, n_head, dropout):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(block_size, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList([Block(d_model, n_head, dropout) for _ in range(n_layer)])
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx, targets):
        x = self.drop(self.tok(idx) + self.pos(torch.arange(idx.shape[1])))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


class Windows(Dataset):
    """Every ``block_size``-byte window of the corpus, with its next-byte targets."""

    def __init__(self, block_size, max_bytes=2_000_000):
        root, chunks, total = sysconfig.get_paths()["stdlib"], [], 0
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "test"))
            for name in sorted(f for f in filenames if f.endswith(".py")):
                with open(os.path.join(dirpath, name), "rb") as f:
                    chunks.append(f.read())
                total += len(chunks[-1])
            if total >= max_bytes:
                break
        self.data = torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8)
        self.block_size = block_size

    def __len__(self):
        return (len(self.data) - 1) // self.block_size

    def __getitem__(self, i):
        chunk = self.data[i * self.block_size:(i + 1) * self.block_size + 1].long()
        return chunk[:-1], chunk[1:]


def get_lr(it, max_iters, lr, warmup):
    if it < warmup:
        return lr * (it + 1) / warmup
    progress = (it - warmup) / max(1, max_iters - warmup)
    return 0.1 * lr + 0.45 * lr * (1 + math.cos(math.pi * progress))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--d-model", type=int, default=96)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--out-dir", default=None, help="write ckpt.pt here every --ckpt-every steps")
    p.add_argument("--ckpt-every", type=int, default=10)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    master_process = rank == 0
    torch.manual_seed(args.seed)
    model = GPT(256, args.block_size, args.n_layer, args.d_model, args.n_head, args.dropout)
    model = DDP(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=4)
    data = Windows(args.block_size)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, seed=args.seed)
    loader = StatefulDataLoader(data, batch_size=args.batch_size, sampler=sampler,
                                num_workers=2, prefetch_factor=2)
    batches = iter(loader)
    t_prev = time.perf_counter()
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = get_lr(step, args.steps, args.lr, warmup=5)
        for micro in range(args.grad_accum):
            # all-reduce the gradients in the last micro-step only, as nanoGPT does
            model.require_backward_grad_sync = micro == args.grad_accum - 1
            x, y = next(batches)
            loss = model(x, y) / args.grad_accum
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        t_now = time.perf_counter()   # step to step, everything in between included
        if master_process:
            print(f"step {step} loss {loss.item() * args.grad_accum:.4f} "
                  f"{1000 * (t_now - t_prev):.1f} ms", flush=True)
            if args.out_dir and (step + 1) % args.ckpt_every == 0:
                os.makedirs(args.out_dir, exist_ok=True)
                torch.save({"model": model.module.state_dict(), "step": step},
                           os.path.join(args.out_dir, "ckpt.pt"))
        t_prev = t_now


if __name__ == "__main__":
    main()
