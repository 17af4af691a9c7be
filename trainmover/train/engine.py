"""The training engine of one worker: a 1F1B pipeline schedule over micro-batches, bucketed
data-parallel gradient all-reduce overlapped with the last backward, global-norm clipping,
AdamW with a warm-up + cosine schedule.

The engine is one client of the runtime: it is given the worker's ``CommGroups`` and never
builds or replaces groups itself. ``train_step`` reads top to bottom; anything about
membership or migration happens between steps, outside it.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import torch

from trainmover.comm.groups import CommGroups, Work
from trainmover.train.buckets import GradBuckets
from trainmover.core.config import JobConfig
from trainmover.train.data import BatchSource
from trainmover.train.model import GPTStage, dropout_seed
from trainmover.train.state import shard_dim
from trainmover.core.topology import Role


def lr_at(step: int, lr: float, min_lr: float, warmup: int, total: int) -> float:
    """Linear warm-up, then cosine decay to ``min_lr`` at the last step. Pure in ``step``."""
    if warmup and step < warmup:
        return lr * (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def adamw(params: list, tc) -> torch.optim.AdamW:
    """The built-in trainer's optimizer (``TrainConfig`` ``tc``): AdamW with weight decay on
    matrices only, foreach off; the benchmarks that build its model outside a job use it too."""
    return torch.optim.AdamW(
        [{"params": [p for p in params if p.dim() >= 2], "weight_decay": tc.weight_decay},
         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
        lr=tc.lr, betas=(tc.beta1, tc.beta2), eps=tc.eps, foreach=False)


@dataclass
class StepResult:
    step: int
    loss: float | None        # global mean loss, on last-stage ranks only
    grad_norm: float
    lr: float
    step_time_s: float
    committed: bool = True


class Engine:
    """Owns one stage's model, optimizer and data view; runs training steps."""

    def __init__(self, cfg: JobConfig, role: Role, groups: CommGroups, batches: BatchSource,
                 device: torch.device):
        self.cfg, self.role, self.groups, self.batches = cfg, role, groups, batches
        self.device = device
        layout, tc = cfg.layout, cfg.train
        self.num_microbatches = tc.num_microbatches
        self.micro_batch = tc.micro_batch_size(layout)
        self.model = GPTStage(cfg.model, layout, role.pp, role.tp, groups).to(device)
        self.model.init_weights(tc.seed)
        self.params = list(self.model.parameters())
        self.grads = GradBuckets(self.params, int(tc.bucket_mb * 2**20), groups)
        self.optimizer = adamw(self.params, tc)
        self.forward = torch.compile(self.model) if tc.compile else self.model
        self.act_shape = (self.micro_batch, cfg.model.seq_len, cfg.model.d_model)
        self.on_point: Callable[[str, int], None] | None = None   # fault points
        self.on_batch: Callable[[torch.Tensor], None] | None = None   # data fingerprint

    # --- one training step -------------------------------------------------------------
    def train_step(self, step: int, commit: Callable[..., bool] | None = None) -> StepResult:
        """One step. With ``commit`` (the runtime's commit point), every collective of the
        step comes first, then the vote; the optimizer touches nothing unless the job decided
        to commit the step, so a failure anywhere leaves every rank's state exactly as it was
        before the step (``committed`` False: the runtime redoes or recovers it)."""
        t0 = time.perf_counter()
        self.grads.zero()
        loss = self._pipeline(step)
        self._point("allreduce", step)
        self.grads.finish()
        grad_norm = self._clip_gradients()
        if loss is not None and self.groups.dp.size > 1:
            self.groups.dp.allreduce(loss)
            loss /= self.groups.dp.size
        lr = lr_at(step, self.cfg.train.lr, self.cfg.train.min_lr, self.cfg.train.warmup_steps,
                   self.cfg.train.steps)
        loss_value = None if loss is None else float(loss)
        if commit is not None and not commit(loss=loss_value, grad_norm=grad_norm, lr=lr):
            return StepResult(step, loss_value, grad_norm, lr, time.perf_counter() - t0, False)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        return StepResult(step, loss_value, grad_norm, lr, time.perf_counter() - t0)

    def _point(self, name: str, step: int) -> None:
        """Named points inside a step where tests and chaos runs inject faults."""
        if self.on_point is not None:
            self.on_point(name, step)

    # --- pipeline ------------------------------------------------------------------------
    def _pipeline(self, step: int) -> torch.Tensor | None:
        """1F1B: stage s runs (pp - 1 - s) warm-up forwards, then alternates one forward and
        one backward, then drains the remaining backwards. Sends are asynchronous and waited
        at the end of the step, so two neighbours sending to each other never deadlock;
        receives block, and the data dependencies between stages order everything else."""
        model, m = self.model, self.num_microbatches
        dp_rank, stage, pp = self.role.dp, self.role.pp, self.cfg.layout.pp
        first, last = self.model.has_embedding, self.model.has_head
        inputs, targets = (None, None)
        if first or last:
            tokens, labels = self.batches.batch(step, dp_rank, self.cfg.layout.dp)
            if self.on_batch is not None:
                self.on_batch(tokens)
            inputs = tokens.to(self.device).chunk(m)
            targets = labels.to(self.device).chunk(m)
        sends: list[tuple[Work, torch.Tensor]] = []
        stash: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        loss_sum = torch.zeros((), device=self.device) if last else None

        def forward(i: int) -> None:
            if self.cfg.model.dropout > 0:
                torch.manual_seed(dropout_seed(self.cfg.train.seed, dp_rank, stage, step, i))
            if first:
                x_in, x = None, inputs[i]
            else:
                x_in = torch.empty(self.act_shape, device=self.device)
                self.groups.p2p_prev.recv(x_in, 0, tag=2 * i).wait()
                x = x_in.requires_grad_()
            out = self.forward(x)
            if last:
                out = model.loss(out, targets[i]) / m
                loss_sum.add_(out.detach())
            else:
                sends.append((self.groups.p2p_next.send(out.detach(), 1, tag=2 * i), out))
            stash[i] = (x_in, out)

        def backward(i: int) -> None:
            x_in, out = stash.pop(i)
            if i == m - 1:
                self._point("backward", step)
                self.grads.arm()  # the step's last backward: launch DP buckets as they fill
            if last:
                out.backward()
            else:
                grad = torch.empty(self.act_shape, device=self.device)
                self.groups.p2p_next.recv(grad, 1, tag=2 * i + 1).wait()
                out.backward(grad)
            if not first:
                g = x_in.grad
                sends.append((self.groups.p2p_prev.send(g, 0, tag=2 * i + 1), g))

        warmup = min(pp - 1 - stage, m)
        for i in range(warmup):
            forward(i)
        for i in range(m - warmup):
            forward(warmup + i)
            backward(i)
        for i in range(m - warmup, m):
            backward(i)
        for work, _ in sends:
            work.wait()
        return loss_sum

    # --- clipping ------------------------------------------------------------------------
    def _clip_gradients(self) -> float:
        """Global L2 norm over the whole model: TP-sharded gradients count on every TP rank,
        replicated ones once (on TP rank 0); summed over TP, then over pipeline stages.
        Data-parallel replicas hold identical gradients after the all-reduce."""
        sharded = torch.zeros((), device=self.device)
        for p in self.params:
            if shard_dim(p) is not None or self.role.tp == 0:
                sharded += p.grad.float().pow(2).sum()
        self.groups.tp.allreduce(sharded)
        self.groups.pp.allreduce(sharded)
        norm = float(sharded.sqrt())
        clip = self.cfg.train.grad_clip
        if clip > 0 and norm > clip:
            scale = clip / (norm + 1e-6)
            for buf in self.grads.buffers:
                buf.mul_(scale)
        return norm
