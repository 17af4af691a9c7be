"""A decoder-only GPT split into pipeline stages, with Megatron-style tensor parallelism.

Tensor parallelism: attention splits heads (q, k, v column-parallel, output projection
row-parallel), the MLP splits its hidden width (fc1 column-, fc2 row-parallel), and the head
splits the vocabulary (column-parallel, with a vocabulary-parallel cross-entropy). The
embedding, layer norms and row-parallel biases are replicated; their gradients come out
identical on every tensor-parallel rank because every path into them passes a TP all-reduce.

Layout independence: every parameter has a canonical name (``blocks.<global layer>.…``, see
``canonical_name``) and is initialised by drawing the *full* tensor from a generator seeded
with (seed, canonical name) and keeping this rank's slice, so any layout starts from the
same model.
Sharded parameters carry ``_tm_shard_dim`` (the dimension split over TP ranks).

The modules never hold a communicator: they hold the worker's ``CommGroups`` and read its
``tp`` slot when they communicate, so a group switch is seen immediately.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from trainmover.comm.groups import MAX, CommGroups
from trainmover.core.config import ModelConfig
from trainmover.train.data import derive_seed, generator
from trainmover.train.state import SHARD_ATTR, shard_dim
from trainmover.core.topology import Layout, StageKind, split_layers


# --- tensor-parallel autograd primitives -------------------------------------------------

class _CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient backward (input of a column-parallel op)."""

    @staticmethod
    def forward(ctx, x, groups: CommGroups):
        ctx.groups = groups
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        # clone: the incoming buffer may be shared with another branch of the graph
        grad = grad.contiguous().clone()
        ctx.groups.tp.allreduce(grad)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward; identity backward (output of a row-parallel op)."""

    @staticmethod
    def forward(ctx, x, groups: CommGroups):
        x = x.contiguous().clone()
        groups.tp.allreduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


# Collectives are opaque to torch.compile: marking them disabled makes a clean graph break
# instead of Dynamo trying (and failing) to trace into the process-group bindings.
@torch.compiler.disable
def copy_to_tp(x: torch.Tensor, groups: CommGroups) -> torch.Tensor:
    return x if groups.tp.size == 1 else _CopyToTP.apply(x, groups)


@torch.compiler.disable
def reduce_from_tp(x: torch.Tensor, groups: CommGroups) -> torch.Tensor:
    return x if groups.tp.size == 1 else _ReduceFromTP.apply(x, groups)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over logits whose vocabulary dimension is split over TP ranks: the max,
    the softmax denominator and the target logit are each completed by one all-reduce, so no
    rank ever materialises the full logits."""

    @staticmethod
    def forward(ctx, logits, targets, groups: CommGroups, vocab_start: int):
        tp = groups.tp
        logits = logits.float()
        row_max = logits.max(dim=-1).values
        tp.allreduce(row_max, op=MAX)
        shifted = logits - row_max.unsqueeze(-1)
        exp = shifted.exp()
        denom = exp.sum(dim=-1)
        tp.allreduce(denom)
        local = targets - vocab_start
        in_shard = (local >= 0) & (local < logits.shape[-1])
        local = local.clamp(0, logits.shape[-1] - 1)
        target_logit = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1) * in_shard
        tp.allreduce(target_logit)
        loss = denom.log() - target_logit
        probs = exp.div_(denom.unsqueeze(-1))
        ctx.save_for_backward(probs, local, in_shard)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        probs, local, in_shard = ctx.saved_tensors
        grad = probs.clone()
        grad.scatter_add_(-1, local.unsqueeze(-1), -in_shard.to(grad.dtype).unsqueeze(-1))
        return grad * grad_loss.unsqueeze(-1), None, None, None


# --- layers ------------------------------------------------------------------------------

def _sharded(t: torch.Tensor, dim: int | None) -> nn.Parameter:
    p = nn.Parameter(t)
    setattr(p, SHARD_ATTR, dim)
    return p


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W split by output features; the output stays split."""

    def __init__(self, in_features: int, out_features: int, tp: int, bias: bool = True):
        super().__init__()
        self.weight = _sharded(torch.empty(out_features // tp, in_features), 0)
        self.bias = _sharded(torch.empty(out_features // tp), 0) if bias else None

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W split by input features; partial sums are all-reduced over TP and
    the (replicated) bias is added once, after the reduction."""

    def __init__(self, in_features: int, out_features: int, tp: int, groups: CommGroups):
        super().__init__()
        self.groups = groups
        self.weight = _sharded(torch.empty(out_features, in_features // tp), 1)
        self.bias = _sharded(torch.empty(out_features), None)

    def forward(self, x):
        return reduce_from_tp(F.linear(x, self.weight), self.groups) + self.bias


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: int, groups: CommGroups):
        super().__init__()
        self.groups = groups
        self.local_heads = cfg.n_heads // tp
        self.head_dim = cfg.d_model // cfg.n_heads
        self.dropout = cfg.dropout
        self.q = ColumnParallelLinear(cfg.d_model, cfg.d_model, tp)
        # no key bias: softmax ignores a per-row constant, so its true gradient is zero and
        # AdamW would only turn float noise into drift that differs between layouts
        self.k = ColumnParallelLinear(cfg.d_model, cfg.d_model, tp, bias=False)
        self.v = ColumnParallelLinear(cfg.d_model, cfg.d_model, tp)
        self.proj = RowParallelLinear(cfg.d_model, cfg.d_model, tp, groups)

    def forward(self, x):
        b, t, _ = x.shape
        x = copy_to_tp(x, self.groups)
        shape = (b, t, self.local_heads, self.head_dim)
        q, k, v = (m(x).view(shape).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: int, groups: CommGroups):
        super().__init__()
        self.groups = groups
        hidden = cfg.d_model * cfg.mlp_ratio
        self.fc1 = ColumnParallelLinear(cfg.d_model, hidden, tp)
        self.fc2 = RowParallelLinear(hidden, cfg.d_model, tp, groups)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(copy_to_tp(x, self.groups)), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: int, groups: CommGroups):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg, tp, groups)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg, tp, groups)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class Embedding(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, tokens):
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        return self.drop(self.tok(tokens) + self.pos(pos))


class GPTStage(nn.Module):
    """The part of the GPT that one pipeline stage holds, for one TP rank.
    ``forward`` maps tokens (first stage) or hidden states (other stages) to hidden states,
    or, on the last stage, to this rank's vocabulary slice of the logits."""

    def __init__(self, cfg: ModelConfig, layout: Layout, stage: int, tp_rank: int,
                 groups: CommGroups):
        super().__init__()
        self.cfg, self.stage, self.tp_rank, self.tp = cfg, stage, tp_rank, layout.tp
        self.kind = layout.stage_kind(stage)
        self.groups = groups
        self.layers = split_layers(cfg.n_layers, layout.pp)[stage]
        self.has_embedding = self.kind in (StageKind.FIRST, StageKind.ONLY)
        self.has_head = self.kind in (StageKind.LAST, StageKind.ONLY)
        self.embed = Embedding(cfg) if self.has_embedding else None
        # Local indices (0..n-1) keep every stage of the same kind and depth structurally
        # identical, whatever layers it holds, so code compiled for one (a standby's
        # warm-up) serves all of them; ``canonical_name`` restores the global layer index.
        self.blocks = nn.ModuleList([Block(cfg, layout.tp, groups) for _ in self.layers])
        if self.has_head:
            self.norm = nn.LayerNorm(cfg.d_model)
            self.head = ColumnParallelLinear(cfg.d_model, cfg.vocab_size, layout.tp, bias=False)
        self.vocab_start = tp_rank * (cfg.vocab_size // layout.tp)

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        if self.has_head:
            x = self.head(copy_to_tp(self.norm(x), self.groups))
        return x

    def loss(self, local_logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean token cross-entropy (identical on every TP rank)."""
        flat = local_logits.reshape(-1, local_logits.shape[-1])
        per_token = _VocabParallelCrossEntropy.apply(flat, targets.reshape(-1), self.groups,
                                                     self.vocab_start)
        return per_token.mean()

    def canonical_name(self, local: str) -> str:
        """``blocks.<local i>.…`` -> ``blocks.<global layer>.…``; other names are global."""
        if local.startswith("blocks."):
            _, i, rest = local.split(".", 2)
            return f"blocks.{self.layers[int(i)]}.{rest}"
        return local

    # --- initialisation ------------------------------------------------------------------
    def init_weights(self, seed: int) -> None:
        """Deterministic, layout-independent: each full tensor from its own generator."""
        std = 0.02
        out_std = std / math.sqrt(2 * self.cfg.n_layers)
        with torch.no_grad():
            for local, p in self.named_parameters():
                name = self.canonical_name(local)
                dim = shard_dim(p)
                full_shape = list(p.shape)
                if dim is not None:
                    full_shape[dim] *= self.tp
                if name.endswith(".bias"):
                    full = torch.zeros(full_shape)
                elif ".ln" in name or name.startswith("norm."):
                    full = torch.ones(full_shape)
                else:
                    s = out_std if name.endswith(("proj.weight", "fc2.weight")) else std
                    full = torch.empty(full_shape).normal_(0.0, s, generator=generator(seed, "init", name))
                if dim is not None:
                    full = full.chunk(self.tp, dim=dim)[self.tp_rank]
                p.copy_(full)


def dropout_seed(seed: int, dp_rank: int, stage: int, step: int, microbatch: int) -> int:
    """Seed of the dropout stream of one micro-batch forward (same on all TP ranks)."""
    return derive_seed(seed, "dropout", dp_rank, stage, step, microbatch)
