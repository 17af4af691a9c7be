"""``DataParallel``: the runtime's replacement for ``DistributedDataParallel``.

``DistributedDataParallel`` holds its process group for life, and trainmover replaces groups
under a running job (a migration, a recovery), so a user's script wraps its model with
``rt.data_parallel(model)`` instead. It behaves like DDP for the usual loop: the forward is
the module's, ``loss.backward()`` returns with gradients averaged over the data-parallel
replicas (bucketed all-reduces overlapped with the backward pass), and ``no_sync()`` (or
``require_backward_grad_sync = False``, as with DDP) skips the all-reduce for gradient
accumulation; at construction every replica takes the first one's parameters and buffers. It reads the current data-parallel group at every
backward, so a group switch between steps is invisible to the script.
"""
from __future__ import annotations

import contextlib

import torch

from trainmover.comm.groups import CommGroups
from trainmover.train.buckets import GradBuckets


class DataParallel(torch.nn.Module):
    def __init__(self, module: torch.nn.Module, groups: CommGroups, bucket_mb: float = 25.0,
                 on_forward=None, on_point=None):
        super().__init__()
        self.module = module
        params = [p for p in module.parameters() if p.requires_grad]
        self.buckets = GradBuckets(params, int(bucket_mb * 2**20), groups)
        self.buckets.on_point = on_point
        self._sync = True
        self._on_forward = on_forward   # the runtime's batch fingerprint, first forward of a step

    def forward(self, *args, **kwargs):
        self.buckets.restore_views()
        if self._sync and torch.is_grad_enabled():
            self.buckets.arm(auto=True)
        if self._on_forward is not None:
            self._on_forward(args, kwargs)
        return self.module(*args, **kwargs)

    def align(self, groups: CommGroups) -> None:
        """Give every replica the first replica's parameters and buffers, as
        ``DistributedDataParallel`` does at construction: a script that seeds each rank
        differently (``seed + rank``) trains one model, not one per replica. One broadcast
        per dtype (the tensors flattened together)."""
        group = groups.dp
        if group is None or group.size == 1:
            return
        tensors = [t.data for t in list(self.module.parameters()) + list(self.module.buffers())]
        by_dtype: dict[tuple, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault((t.dtype, t.device), []).append(t)
        for same in by_dtype.values():
            flat = torch._utils._flatten_dense_tensors(same)
            group.broadcast(flat, 0)
            for t, value in zip(same, torch._utils._unflatten_dense_tensors(flat, same)):
                t.copy_(value)

    # the DDP attribute scripts set for gradient accumulation (False: skip the all-reduce)
    @property
    def require_backward_grad_sync(self) -> bool:
        return self._sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self._sync = bool(value)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally: backward passes inside skip the all-reduce."""
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old

    def canonical_name(self, local: str) -> str:
        """State names without the wrapper's ``module.`` prefix (and the inner module's own
        renaming, if it has one), so the state is the same with or without the wrapper."""
        name = local.removeprefix("module.")
        rename = getattr(self.module, "canonical_name", None)
        return rename(name) if rename is not None else name
