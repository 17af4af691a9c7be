"""The group handles a training script holds (``rt.groups``): each always reaches its
group's current generation, and gives torch the group's ``ProcessGroup``."""
from __future__ import annotations

import torch

from trainmover.comm.groups import CommGroups, Group
from trainmover.worker.errors import UsageError

_OPS = {"sum": torch.distributed.ReduceOp.SUM, "max": torch.distributed.ReduceOp.MAX,
        "min": torch.distributed.ReduceOp.MIN}


class LiveGroup:
    """A handle on one of this worker's groups that always reaches its current generation:
    it reads the slot at every call, so a handle kept across a migration's group switch
    stays valid. Call its methods (``dp.allreduce(t)``), or hand torch its
    ``process_group`` (``dist.all_reduce(t, group=rt.groups.dp.process_group)``, DDP,
    ``DeviceMesh.from_group``), which moves with it."""

    def __init__(self, holder: CommGroups, slot: str, peer: int | None = None,
                 torch_groups=None):
        self._holder, self._slot = holder, slot
        self.peer = peer   # for a pipeline pair: the other side's rank in it
        self._torch_groups = torch_groups

    @property
    def process_group(self) -> torch.distributed.ProcessGroup:
        """This axis's ``torch.distributed.ProcessGroup``: the same object for the whole run
        of the script, serving the group's current generation."""
        tg = self._torch_groups
        if tg is None:
            raise UsageError("torch process groups are off for this job (comm.torch_groups="
                             "'off', or the built-in trainer): set comm.torch_groups='on'")
        if self._slot not in tg.process_groups:
            raise UsageError(f"rt.groups {self._slot!r} (a pipeline pair) has no torch "
                             f"process group: use rt.groups.pp.process_group")
        return tg.process_groups[self._slot]

    @property
    def group(self) -> Group:
        return getattr(self._holder, self._slot)

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def size(self) -> int:
        return self.group.size

    def allreduce(self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False):
        """In place over the group; ``op``: sum, max, min or avg."""
        if op == "avg":
            work = self.group.allreduce(tensor)
            tensor.div_(self.size)
            return work
        return self.group.allreduce(tensor, _OPS[op], async_op=async_op)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False):
        return self.group.broadcast(tensor, src, async_op=async_op)

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return self.group.allgather(tensor)

    def send(self, tensor: torch.Tensor, peer: int | None = None, tag: int = 0):
        """Asynchronous: returns a work to ``wait()`` on."""
        return self.group.send(tensor, self.peer if peer is None else peer, tag)

    def recv(self, tensor: torch.Tensor, peer: int | None = None, tag: int = 0):
        return self.group.recv(tensor, self.peer if peer is None else peer, tag)

    def barrier(self) -> None:
        self.group.barrier()


class GroupView:
    """``rt.groups``: ``dp``, ``tp``, ``pp`` (the pipeline column: loss and norm reductions)
    and ``prev`` / ``next`` (the pipeline neighbours; None at the ends)."""

    def __init__(self, holder: CommGroups, torch_groups=None):
        self.dp = LiveGroup(holder, "dp", torch_groups=torch_groups)
        self.tp = LiveGroup(holder, "tp", torch_groups=torch_groups)
        self.pp = LiveGroup(holder, "pp", torch_groups=torch_groups)
        self.prev = LiveGroup(holder, "p2p_prev", peer=0) if holder.p2p_prev else None
        self.next = LiveGroup(holder, "p2p_next", peer=1) if holder.p2p_next else None
