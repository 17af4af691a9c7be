"""Training state in one canonical, layout-independent form.

A worker's *local state* maps canonical names to this rank's tensors:
``model/<param>``, ``optim/exp_avg/<param>``, ``optim/exp_avg_sq/<param>`` and
``optim/step``; TP-sharded entries record the dimension they are split on. Assembling the
local states of the dp-rank-0 roles gives the *canonical state*: full tensors, the same for
any layout that trained the same model, which is what ``weights_sha256`` hashes and what the
final checkpoint stores. Live transfer and checkpoints both speak this one interface.
"""
from __future__ import annotations

import ctypes
import hashlib

import torch

from .topology import Layout, Role

# A parameter split over tensor-parallel ranks declares the dimension it is split on with this
# attribute; everything without it is replicated. This is the whole contract between a model
# and the runtime's state handling, so the runtime never imports a model.
SHARD_ATTR = "_tm_shard_dim"


def shard_dim(p: torch.Tensor) -> int | None:
    return getattr(p, SHARD_ATTR, None)


def canonical_params(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """Parameters under their canonical names: a model whose local names differ from the
    global ones (a pipeline stage numbering its blocks from 0) maps them with
    ``canonical_name(local_name)``."""
    rename = getattr(model, "canonical_name", None)
    return [(rename(n) if rename else n, p) for n, p in model.named_parameters()]


def local_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer
                ) -> tuple[dict[str, torch.Tensor], dict[str, int | None]]:
    """This rank's tensors by canonical name, and each entry's TP shard dimension."""
    tensors: dict[str, torch.Tensor] = {}
    dims: dict[str, int | None] = {}
    step = None
    for name, p in canonical_params(model):
        tensors[f"model/{name}"] = p.detach()
        dims[f"model/{name}"] = shard_dim(p)
        st = optimizer.state.get(p, {})
        for key in ("exp_avg", "exp_avg_sq"):
            if key in st:
                tensors[f"optim/{key}/{name}"] = st[key]
                dims[f"optim/{key}/{name}"] = shard_dim(p)
        if "step" in st:
            step = st["step"]
    if step is not None:
        tensors["optim/step"] = torch.as_tensor(step).detach().reshape(())
        dims["optim/step"] = None
    return tensors, dims


def assemble(shards: dict[Role, tuple[dict[str, torch.Tensor], dict[str, int | None]]],
             layout: Layout) -> dict[str, torch.Tensor]:
    """Canonical full tensors from the local states of every (pp, tp) of data-parallel rank 0."""
    out: dict[str, torch.Tensor] = {}
    for pp in range(layout.pp):
        parts = [shards[Role(0, pp, tp)] for tp in range(layout.tp)]
        for name, dim in parts[0][1].items():
            if name in out:  # optim/step appears on every stage; they agree
                continue
            if dim is None:
                out[name] = parts[0][0][name].detach().cpu().clone()
            else:
                out[name] = torch.cat([p[0][name].detach().cpu() for p in parts], dim=dim)
    return dict(sorted(out.items()))


def state_digest(state: dict[str, torch.Tensor]) -> str:
    """sha256 over names, dtypes, shapes and raw bytes, in sorted name order."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()))
    return h.hexdigest()


def apply_local_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                      tensors: dict[str, torch.Tensor]) -> None:
    """Overwrite a rank's parameters and AdamW state from its local state (the inverse of
    ``local_state``); creates the optimizer state if the optimizer has not stepped yet."""
    with torch.no_grad():
        step = tensors.get("optim/step")
        for name, p in canonical_params(model):
            p.copy_(tensors[f"model/{name}"])
            if step is None:
                continue
            st = optimizer.state[p]
            for key in ("exp_avg", "exp_avg_sq"):
                src = tensors[f"optim/{key}/{name}"]
                if key in st:
                    st[key].copy_(src)
                else:
                    st[key] = src.to(p.device).clone()
            st["step"] = torch.tensor(float(step), dtype=torch.float32)
