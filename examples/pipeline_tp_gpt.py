"""A nanoGPT-style GPT trained with pipeline, tensor and data parallelism under trainmover,
on the Python standard library's own sources as a byte-level corpus (no download).

    trainmover launch --dp 1 --pp 2 --tp 2 -- python examples/pipeline_tp_gpt.py
    trainmover launch --dp 2 --pp 2 --tp 1 --standbys 1 -- python examples/pipeline_tp_gpt.py

Each worker holds one pipeline stage (a contiguous run of blocks; the embedding lives on the
first stage, the head on the last) and one tensor-parallel slice of it (a share of every
block's attention heads and MLP hidden units). Stages exchange activations and gradients with
their pipeline neighbours; data-parallel replicas of a stage average their gradients through
`rt.data_parallel`. `ddp_gpt.py` is the data-parallel-only version of the same model.
"""
import argparse
import math
import os
import sysconfig
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import trainmover

# trainmover's mark on a tensor-parallel shard (see trainmover/train/state.py): the dimension
# it is split on, so the job's final state concatenates the tp ranks' shards along it.
# Parameters without it are replicated and taken from tp rank 0.
SHARD_DIM = "_tm_shard_dim"


# --- tensor parallelism ------------------------------------------------------------------
# A split layer runs in two halves: a "column" half (q, k, v, fc1) holds a slice of the output
# features, a "row" half (proj, fc2) the matching slice of the input features. Each tp rank
# then computes a partial sum of the block's output, and two autograd functions close the
# region: one sums the partial outputs over the tp group (forward), the other sums the
# partial input gradients (backward). Everything outside the region, replicated on every tp
# rank, sees full tensors and gets identical gradients on every tp rank.

class _EnterTP(torch.autograd.Function):
    """Identity forward; backward sums the input gradient over the tp group (each rank's
    column slice contributed only part of it)."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        # a copy: autograd may share the incoming buffer, and the all-reduce works in place
        grad = grad.clone(memory_format=torch.contiguous_format)
        ctx.tp.allreduce(grad)
        return grad, None


class _LeaveTP(torch.autograd.Function):
    """Forward sums the tp ranks' partial outputs; backward is the identity (every rank
    already holds the full gradient of the summed output)."""

    @staticmethod
    def forward(ctx, x, tp):
        x = x.clone(memory_format=torch.contiguous_format)
        tp.allreduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def keep_shard(module, name, dim, rank, size):
    """Replace the full parameter `module.<name>` by this rank's slice of it along `dim`."""
    full = getattr(module, name)
    part = nn.Parameter(full.detach().chunk(size, dim=dim)[rank].clone())
    setattr(part, SHARD_DIM, dim)
    setattr(module, name, part)


# --- the model ---------------------------------------------------------------------------

class Block(nn.Module):
    """The transformer block of ddp_gpt.py, with q, k, v as separate layers so that each can
    be split by heads; whole until `split` keeps one tp rank's share of it."""

    def __init__(self, d_model, n_head):
        super().__init__()
        self.head_dim = d_model // n_head
        self.tp = None   # the tp group once the block is split (see `split`)
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.q, self.k, self.v = (nn.Linear(d_model, d_model) for _ in range(3))
        self.proj = nn.Linear(d_model, d_model)
        self.fc1, self.fc2 = nn.Linear(d_model, 4 * d_model), nn.Linear(4 * d_model, d_model)

    def split(self, tp, rank, size):
        """Keep tp rank `rank`'s 1/size of the attention heads (the rows of q, k and v are laid
        out head after head, so a contiguous slice is whole heads) and of the MLP units."""
        for linear in (self.q, self.k, self.v, self.fc1):
            keep_shard(linear, "weight", 0, rank, size)
            keep_shard(linear, "bias", 0, rank, size)
        for linear in (self.proj, self.fc2):
            # the bias stays whole: it is added once, after the partial sums are summed
            keep_shard(linear, "weight", 1, rank, size)
        self.tp = tp

    def _enter(self, x):
        return x if self.tp is None else _EnterTP.apply(x, self.tp)

    def _leave(self, partial):
        return partial if self.tp is None else _LeaveTP.apply(partial, self.tp)

    def forward(self, x):
        b, t, _ = x.shape
        h = self._enter(self.ln1(x))
        # -1: as many heads as this rank holds
        q, k, v = (m(h).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        x = x + self._leave(F.linear(y.reshape(b, t, -1), self.proj.weight)) + self.proj.bias
        h = F.gelu(self.fc1(self._enter(self.ln2(x))))
        return x + self._leave(F.linear(h, self.fc2.weight)) + self.fc2.bias


class GPT(nn.Module):
    """The whole model, or once `keep_stage` ran, one pipeline stage of it: tokens or hidden
    states in, hidden states or (last stage) logits out."""

    def __init__(self, vocab, block_size, n_layer, d_model, n_head):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(block_size, d_model)
        # keyed by the global layer index: a stage's parameter names (blocks.2.q.weight) are
        # then unique across the pipeline, which the job's final state needs
        self.blocks = nn.ModuleDict({str(i): Block(d_model, n_head) for i in range(n_layer)})
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def keep_stage(self, stage, n_stages, tp, tp_rank, tp_size):
        """Drop what other stages hold and split the blocks kept over the tp group. The
        embedding, final norm and head stay whole on every tp rank (they are small here)."""
        n = len(self.blocks)
        mine = range(stage * n // n_stages, (stage + 1) * n // n_stages)
        for i in list(self.blocks):
            if int(i) in mine:
                self.blocks[i].split(tp, tp_rank, tp_size)
            else:
                del self.blocks[i]
        if stage > 0:
            self.tok = self.pos = None
        if stage < n_stages - 1:
            self.ln = self.head = None
        return self

    def forward(self, x):
        if self.tok is not None:
            x = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks.values():
            x = block(x)
        if self.head is not None:
            x = self.head(self.ln(x))
        return x


# --- data and schedule (as in ddp_gpt.py) ------------------------------------------------

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
    seeded by (seed, step); each data-parallel rank takes its slice of the global batch."""
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


def clip_grad_norm(params, max_norm, rt):
    """Clip by the norm of the whole model's gradient, which no worker holds alone: a tp
    shard's squares are summed over the tp group, a replicated gradient counted once (tp
    rank 0), then the stages' sums over the pipeline. Data-parallel replicas already agree."""
    sq = torch.zeros((), device=rt.device)
    for p in params:
        if getattr(p, SHARD_DIM, None) is not None or rt.tp_rank == 0:
            sq += p.grad.float().pow(2).sum()
    rt.groups.tp.allreduce(sq)
    rt.groups.pp.allreduce(sq)
    norm = sq.sqrt()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for p in params:
        p.grad.mul_(scale)
    return norm.item()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=16, help="global, over all dp replicas")
    p.add_argument("--micro-batches", type=int, default=4, help="per replica and step")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1337)
    args = p.parse_args()
    rt = trainmover.init()
    m, per_replica = args.micro_batches, args.batch_size // rt.dp_size
    if per_replica * rt.dp_size != args.batch_size or per_replica % m:
        p.error(f"--batch-size {args.batch_size} must split into {rt.dp_size} replicas of "
                f"{m} equal micro-batches")
    if args.n_layer < rt.pp_size or args.n_head % rt.tp_size:
        p.error(f"need at least {rt.pp_size} layers and heads divisible by {rt.tp_size}")

    # Every worker builds the whole model from the same seed, then keeps its stage and its tp
    # slice: initial weights are the same for any layout, and a joiner rebuilding its role
    # gets the same structure (the values it then receives overwrite these).
    torch.manual_seed(args.seed)
    model = GPT(256, args.block_size, args.n_layer, args.d_model, args.n_head)
    model = model.keep_stage(rt.pp_rank, rt.pp_size, rt.groups.tp, rt.tp_rank, rt.tp_size)
    model = rt.data_parallel(model.to(rt.device))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    rt.register(model=model, optimizer=opt)
    rt.tokens_per_step = args.batch_size * args.block_size
    data = load_corpus()
    act_shape = (per_replica // m, args.block_size, args.d_model)   # what crosses stages

    for step in rt.steps(args.steps):
        t0 = time.perf_counter()
        # every stage draws the batch (only the first uses the tokens, the last the targets),
        # every tp rank the same one
        x, y = get_batch(data, step, rt.dp_rank, rt.dp_size, args.batch_size, args.block_size,
                         args.seed)
        xs, ys = x.to(rt.device).chunk(m), y.to(rt.device).chunk(m)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, warmup=5)
        sends, losses = [], []   # sends: (work, tensor); a tensor must outlive its send

        def forward(i):
            if rt.is_first_stage:
                inp = xs[i]
            else:
                inp = torch.empty(act_shape, device=rt.device)
                rt.groups.prev.recv(inp, tag=2 * i).wait()   # even tags: activations
                inp.requires_grad_()   # its gradient goes back to the previous stage
            out = model(inp)
            if rt.is_last_stage:
                # divided by m: the micro-batches' gradients add up to the batch's mean
                out = F.cross_entropy(out.view(-1, out.shape[-1]), ys[i].reshape(-1)) / m
                losses.append(out.detach())
            else:
                act = out.detach()
                sends.append((rt.groups.next.send(act, tag=2 * i), act))
            return inp, out

        def backward(i, inp, out):
            if rt.is_last_stage:
                out.backward()
            else:
                grad = torch.empty(act_shape, device=rt.device)
                rt.groups.next.recv(grad, tag=2 * i + 1).wait()   # odd tags: gradients
                out.backward(grad)
            if not rt.is_first_stage:
                sends.append((rt.groups.prev.send(inp.grad, tag=2 * i + 1), inp.grad))

        # GPipe: all forwards, then all backwards, gradients accumulating without the
        # data-parallel all-reduce (no_sync). The wrapper arms that all-reduce at a forward
        # outside no_sync and runs it during the *next* backward, so the last micro-batch
        # goes through the pipeline on its own, after the others' backwards: its backward is
        # then the step's last, and the all-reduce sees the whole step's gradients.
        with model.no_sync():
            stash = [forward(i) for i in range(m - 1)]
            for i, (inp, out) in enumerate(stash):
                backward(i, inp, out)
        backward(m - 1, *forward(m - 1))
        for work, _ in sends:
            work.wait()

        norm = clip_grad_norm(list(model.parameters()), 1.0, rt)
        loss = None
        if rt.is_last_stage:
            loss_t = torch.stack(losses).sum()
            # the mean over all replicas, so the logged loss is the whole batch's
            rt.groups.dp.allreduce(loss_t, op="avg")
            loss = loss_t.item()
        # the commit point: after the step's last collective, before the optimizer
        committed = rt.commit(loss=loss, grad_norm=norm) if rt.is_last_stage else rt.commit()
        if committed:
            opt.step()
        opt.zero_grad(set_to_none=True)
        if rt.is_last_stage and rt.dp_rank == 0 and rt.tp_rank == 0 and not rt.sandbox:
            print(f"step {step} loss {loss:.4f} norm {norm:.3f} "
                  f"{(time.perf_counter() - t0) * 1000:.0f} ms", flush=True)


if __name__ == "__main__":
    main()
