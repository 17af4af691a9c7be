"""Live state transfer from a leaver to its joiner over a two-member group.

What moves: parameters, AdamW moments and step count, the RNG state, and the step at which
the joiner resumes (the data position is a pure function of that step). The leaver's
gradient buckets are the staging buffers: at an iteration boundary they hold nothing that
is needed (the next step zeroes them), so the transfer costs no extra memory on the leaver,
and the joiner receives into its own buckets the same way. One message per bucket and per
state kind keeps the message count small whatever the number of parameters.
"""
from __future__ import annotations

import time

import torch

from .comm import Group

_KINDS = ("param", "exp_avg", "exp_avg_sq")


def _tensors_of(engine, kind: str) -> list[torch.Tensor]:
    """For each parameter in bucket order, the tensor of ``kind``."""
    out = []
    for bucket in engine.grads.buckets:
        for p in bucket:
            out.append(p.data if kind == "param" else engine.optimizer.state[p][kind])
    return out


def _per_bucket(engine, kind: str):
    tensors = iter(_tensors_of(engine, kind))
    for bucket, buf in zip(engine.grads.buckets, engine.grads.buffers):
        yield buf, [(next(tensors), p.numel()) for p in bucket]


def optimizer_step_count(engine) -> int:
    state = engine.optimizer.state
    p = engine.params[0]
    return int(state[p]["step"]) if p in state and "step" in state[p] else 0


def ensure_optimizer_state(engine, step_count: int) -> None:
    """Create AdamW's lazily-initialised state so it can be received into."""
    for p in engine.params:
        st = engine.optimizer.state[p]
        if "exp_avg" not in st:
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        st["step"] = torch.tensor(float(step_count), dtype=torch.float32)


def send_state(engine, group: Group, peer: int, resume_step: int) -> dict:
    """Leaver side. Returns byte and time accounting."""
    t0 = time.perf_counter()
    opt_steps = optimizer_step_count(engine)
    rng = torch.get_rng_state()
    meta = torch.tensor([resume_step, opt_steps, rng.numel()], dtype=torch.int64)
    group.send(meta, peer, tag=0).wait()
    group.send(rng, peer, tag=1).wait()
    nbytes = 0
    kinds = _KINDS if opt_steps > 0 else _KINDS[:1]
    tag = 2
    for kind in kinds:
        for buf, parts in _per_bucket(engine, kind):
            offset = 0
            for t, n in parts:
                buf[offset:offset + n].copy_(t.reshape(-1))
                offset += n
            group.send(buf, peer, tag=tag).wait()
            tag += 1
            nbytes += buf.numel() * buf.element_size()
    return {"bytes": nbytes, "seconds": time.perf_counter() - t0}


def recv_state(engine, group: Group, peer: int) -> tuple[int, dict]:
    """Joiner side: overwrites parameters and optimizer state. Returns the step to resume at."""
    t0 = time.perf_counter()
    meta = torch.zeros(3, dtype=torch.int64)
    group.recv(meta, peer, tag=0).wait()
    resume_step, opt_steps, rng_len = (int(x) for x in meta)
    rng = torch.zeros(rng_len, dtype=torch.uint8)
    group.recv(rng, peer, tag=1).wait()
    torch.set_rng_state(rng)
    kinds = _KINDS if opt_steps > 0 else _KINDS[:1]
    if opt_steps > 0:
        ensure_optimizer_state(engine, opt_steps)
    nbytes, tag = 0, 2
    with torch.no_grad():
        for kind in kinds:
            for buf, parts in _per_bucket(engine, kind):
                group.recv(buf, peer, tag=tag).wait()
                tag += 1
                offset = 0
                for t, n in parts:
                    t.copy_(buf[offset:offset + n].view_as(t))
                    offset += n
                nbytes += buf.numel() * buf.element_size()
    return resume_step, {"bytes": nbytes, "seconds": time.perf_counter() - t0}
