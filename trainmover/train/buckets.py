"""Gradient buckets: the data-parallel all-reduce of a worker's gradients.

Gradients live in flat per-bucket buffers (``param.grad`` is a view into one), so the
all-reduce runs on whole buckets with no copy, and the same buffers are the staging area of
a live state transfer (at an iteration boundary they hold nothing needed). Buckets are filled
in reverse parameter order (roughly the order backward produces them) and launched strictly
in index order: every replica then issues the same collectives in the same order, which gloo
requires (it matches operations by sequence, not by content).

Two ways to drive them: the built-in engine calls ``arm`` before its last backward and
``finish`` after it; ``auto`` mode (the ``DataParallel`` wrapper users get) arms at each
synchronising forward and finishes from a callback at the end of the backward pass, as
``DistributedDataParallel`` does, so ``loss.backward()`` returns with averaged gradients.
"""
from __future__ import annotations

from typing import Callable

import torch

from trainmover.comm.groups import CommGroups, Work


class GradBuckets:
    def __init__(self, params: list[torch.nn.Parameter], bucket_bytes: int, groups: CommGroups):
        self.groups = groups
        self.buckets: list[list[torch.nn.Parameter]] = []
        self.buffers: list[torch.Tensor] = []
        current, size = [], 0
        for p in reversed(params):
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= bucket_bytes:
                self.buckets.append(current)
                current, size = [], 0
        if current:
            self.buckets.append(current)
        self.bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.views: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        self._allocate([torch.zeros(sum(p.numel() for p in b), dtype=b[0].dtype,
                                    device=b[0].device) for b in self.buckets])
        self._pending = [0] * len(self.buckets)
        self._next = 0
        self._works: list[Work] = []
        self._armed = False
        self._finish_queued = False
        self.on_point: Callable[[str], None] | None = None   # fault points (backward, allreduce)
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def quarantine(self) -> None:
        """After an aborted step: fresh buffers (zero), every ``param.grad`` a view into them.

        Why: an all-reduce the step abandoned cannot be cancelled (gloo), and it still holds
        the old buffers; if the lost peer's data arrives later (a host whose link comes
        back), it completes and writes the sum into them. Left in use, they would corrupt a
        later step's gradients. The abandoned operation keeps its own reference to the old
        memory, so dropping ours is safe."""
        self._armed = False
        self._works = []
        self._allocate([torch.zeros_like(buf) for buf in self.buffers])

    def _allocate(self, buffers: list[torch.Tensor]) -> None:
        """Make ``buffers`` the buckets' memory: every ``param.grad`` a view into its own."""
        self.buffers, self.views = buffers, []
        for bucket, buf in zip(self.buckets, buffers):
            offset = 0
            for p in bucket:
                view = buf[offset:offset + p.numel()].view_as(p)
                p.grad = view
                self.views.append((p, view))
                offset += p.numel()

    def zero(self) -> None:
        self._armed = False  # an aborted step may have left the hooks armed
        for buf in self.buffers:
            buf.zero_()

    def restore_views(self) -> None:
        """Point every ``param.grad`` back into its bucket: ``optimizer.zero_grad()`` sets
        them to None by default (which means zero), and a gradient accumulated outside the
        bucket is copied in."""
        for p, view in self.views:
            g = p.grad
            if g is None:
                view.zero_()
                p.grad = view
            elif g.data_ptr() != view.data_ptr():
                view.copy_(g)
                p.grad = view

    def arm(self, auto: bool = False) -> None:
        """Call before the step's last backward: from now on each finished bucket is launched
        (``auto``: and waited for at the end of that backward pass)."""
        self._pending = [len(b) for b in self.buckets]
        self._next = 0
        self._works = []
        self._armed = self.groups.dp.size > 1
        self._auto = auto
        self._finish_queued = False

    def _on_grad_ready(self, p: torch.nn.Parameter) -> None:
        if not self._armed:
            return
        if self._auto and not self._finish_queued:
            self._finish_queued = True
            if self.on_point is not None:
                self.on_point("backward")
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
        i = self.bucket_of[id(p)]
        self._pending[i] -= 1
        while self._next < len(self.buckets) and self._pending[self._next] == 0:
            self._works.append(self.groups.dp.allreduce(self.buffers[self._next], async_op=True))
            self._next += 1

    def finish(self) -> None:
        """Wait for every bucket's all-reduce and average over replicas."""
        if not self._armed:
            return
        if self._auto and self.on_point is not None:
            self.on_point("allreduce")
        if self._next != len(self.buckets):
            raise RuntimeError(f"only {self._next}/{len(self.buckets)} gradient buckets were "
                               f"ready after backward: a parameter received no gradient")
        for w in self._works:
            w.wait()
        dp = self.groups.dp.size
        for buf in self.buffers:
            buf.div_(dp)
        self._armed = False
