"""Record and replay of cross-worker communication, for the standby's sandboxed warm-up.

Record: during a job's first step, one representative role of each distinct stage structure
(kind and depth) runs with its group slots wrapped in ``RecordingGroup``s, which keep a copy
of every collective's output and every received tensor. The wrappers are then removed, so
steady-state steps pay nothing. The recording is saved with a manifest naming the model,
layout, batch settings and code version it belongs to.

Replay: a standby builds the *normal* engine for a representative role on ``SandboxGroup``s,
which answer collectives and receives from the recording in order, skip sends and barriers,
and never touch the network; then it runs real ``train_step``s. Imports, allocation,
autograd, compilation and data access are all warmed by the code that will run for real.
Real values matter: zeros would send norms and losses through paths (NaN, clipping) that the
real job never takes.
"""
from __future__ import annotations

import functools
import hashlib
import os
import time
from dataclasses import dataclass, field

import torch

from trainmover.comm.groups import CommGroups, Group, _DoneWork
from trainmover.core.config import JobConfig
from trainmover.core.identity import script_digest
from trainmover.core.topology import Layout, Role, StageKind, split_layers

FORMAT = 1


class RecordingInvalid(ValueError):
    """A recording that cannot be used: missing, truncated, or made for another job."""


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """Hash of this package's sources: a recording replays only against the code that made it."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in sorted(os.walk(root)):
        dirnames.sort()
        for name in sorted(filenames):
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, name), root)
                with open(os.path.join(dirpath, name), "rb") as f:
                    h.update(rel.encode() + b"\0" + f.read())
    return h.hexdigest()[:16]


# --- which roles are recorded and warmed (pure) ------------------------------------------

def structure_key(layout: Layout, n_layers: int | None, stage: int) -> str:
    """Stages with equal keys run identical code on identically shaped tensors: the stage's
    kind and, when the model's depth is known (the built-in trainer), its number of layers.
    A script's stages are told apart by kind only (first, middle, last: the paper's three);
    if two of its middle stages differ, the replay finds the mismatch and that structure
    stays cold, with a warning."""
    kind = layout.stage_kind(stage)
    if n_layers is None:
        return kind.value
    return f"{kind.value}-{len(split_layers(n_layers, layout.pp)[stage])}"


def structure_depths(cfg: JobConfig) -> int | None:
    """The model depth that tells stage structures apart: known for the built-in trainer."""
    return cfg.model.n_layers if cfg.process.builtin else None


def representative_roles(layout: Layout, n_layers: int | None) -> dict[str, Role]:
    """One role (data- and tensor-parallel rank 0) per distinct stage structure, in the order
    a standby warms them: first, last, then the middle ones (it stays in a middle role)."""
    out: dict[str, Role] = {}
    for stage in range(layout.pp):
        out.setdefault(structure_key(layout, n_layers, stage), Role(0, stage, 0))
    order = {StageKind.FIRST: 0, StageKind.ONLY: 0, StageKind.LAST: 1, StageKind.MIDDLE: 2}
    return dict(sorted(out.items(), key=lambda kv: (order[layout.stage_kind(kv[1])], kv[1].pp)))


def manifest_for(cfg: JobConfig, key: str, role: Role) -> dict:
    """Everything a replay must agree with; a recording with any other value is stale."""
    tc = cfg.train
    out = {"format": FORMAT, "code_version": code_version(), "structure": key,
           "role": role.name, "layout": cfg.layout.as_dict(), "device": cfg.process.device,
           "command": list(cfg.process.command)}
    if cfg.process.builtin:
        out.update(model=cfg.model.__dict__ | {},
                   batch={"global_batch": tc.global_batch,
                          "num_microbatches": tc.num_microbatches, "bucket_mb": tc.bucket_mb,
                          "compile": tc.compile})
    else:
        out["script_sha256"] = script_digest(cfg.process.command)
    return out


def recording_dir(cfg: JobConfig, run_dir: str) -> str:
    return cfg.standby.recording_dir or os.path.join(run_dir, "recordings")


def recording_path(directory: str, key: str) -> str:
    return os.path.join(directory, f"{key}.pt")


# --- record -------------------------------------------------------------------------------

class _RecordingWork:
    def __init__(self, work, on_done):
        self._work, self._on_done = work, on_done

    def wait(self) -> None:
        self._work.wait()
        self._on_done()


class RecordingGroup:
    """Forwards every operation to the real group and keeps each output, in issue order."""

    def __init__(self, inner: Group, log: list):
        self.inner, self.log = inner, log

    def __getattr__(self, name):  # name, size, rank, generation, spec, device, error, ...
        return getattr(self.inner, name)

    def _keep(self, op: str, tensor: torch.Tensor, work=None):
        entry = [op, None]
        self.log.append(entry)

        def done():
            entry[1] = tensor.detach().to("cpu", copy=True)

        if work is None:
            done()
            return None
        return _RecordingWork(work, done)

    def allreduce(self, tensor, op=None, async_op: bool = False):
        work = self.inner.allreduce(tensor, op, async_op) if op is not None else \
            self.inner.allreduce(tensor, async_op=async_op)
        return self._keep("allreduce", tensor, work if async_op else None)

    def broadcast(self, tensor, src: int, async_op: bool = False):
        work = self.inner.broadcast(tensor, src, async_op)
        return self._keep("broadcast", tensor, work if async_op else None)

    def allgather(self, tensor):
        outs = self.inner.allgather(tensor)
        self.log.append(["allgather", torch.stack([o.detach().cpu() for o in outs])])
        return outs

    def recv(self, tensor, peer: int, tag: int = 0):
        return self._keep("recv", tensor, self.inner.recv(tensor, peer, tag))

    def send(self, tensor, peer: int, tag: int = 0):
        return self.inner.send(tensor, peer, tag)

    def barrier(self) -> None:
        self.inner.barrier()


@dataclass
class Recording:
    manifest: dict
    ops: dict[str, list[tuple[str, torch.Tensor]]]   # slot -> outputs in issue order
    # a script's torch operations (``worker/recording.py``): per recorded step, forwarder ->
    # [(op, name, outputs or None)]; and its pipeline stage initialisations, as
    # (step index, forwarder -> entries a..b of that step's)
    torch_ops: list[dict[str, list]] = field(default_factory=list)
    torch_inits: list = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        own = sum(t.numel() * t.element_size() for ops in self.ops.values() for _, t in ops)
        return own + sum(t.numel() * t.element_size() for tape in self.torch_ops
                         for entries in tape.values() for _, _, outs in entries
                         for t in outs or () if not t.is_meta)


class Recorder:
    """Wraps a worker's group slots for one step, then puts the real groups back."""

    def __init__(self, groups: CommGroups):
        self.groups = groups
        self.logs: dict[str, list] = {}
        self._saved: dict[str, Group] = {}

    def __enter__(self) -> "Recorder":
        for slot, g in self.groups.slots().items():
            if g.size > 1:
                self._saved[slot] = g
                self.logs[slot] = []
                setattr(self.groups, slot, RecordingGroup(g, self.logs[slot]))
        return self

    def __exit__(self, *exc) -> None:
        for slot, g in self._saved.items():
            setattr(self.groups, slot, g)  # the hook is gone: steady steps pay nothing

    def recording(self, manifest: dict) -> Recording:
        missing = [slot for slot, log in self.logs.items() for op, t in log if t is None]
        if missing:
            raise RuntimeError(f"operations on {sorted(set(missing))} were never waited for")
        return Recording(manifest, {s: [(op, t) for op, t in log] for s, log in self.logs.items()})


def save_recording(rec: Recording, path: str) -> float:
    """Atomic: a reader sees a whole recording or none. Returns seconds taken."""
    t0 = time.perf_counter()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save({"manifest": rec.manifest, "ops": rec.ops, "torch_ops": rec.torch_ops,
                "torch_inits": rec.torch_inits}, tmp)
    os.replace(tmp, path)
    return time.perf_counter() - t0


def load_recording(path: str, expected: dict) -> Recording:
    """Raises ``RecordingInvalid`` naming what is wrong; never returns a partial recording."""
    if not os.path.exists(path):
        raise RecordingInvalid(f"no recording at {path}")
    try:
        blob = torch.load(path, weights_only=True)
        manifest, ops = blob["manifest"], blob["ops"]
    except Exception as exc:  # noqa: BLE001 - truncated or not a recording at all
        raise RecordingInvalid(f"recording {path} is unreadable ({type(exc).__name__}: {exc})")
    for key, value in expected.items():
        if key == "role":
            continue
        if manifest.get(key) != value:
            raise RecordingInvalid(f"recording {path} was made for {key}={manifest.get(key)!r}, "
                                   f"this job has {key}={value!r}")
    return Recording(manifest, ops, blob.get("torch_ops", []), blob.get("torch_inits", []))


# --- replay ---------------------------------------------------------------------------------

class SandboxMismatch(RuntimeError):
    """The shadow run issued an operation the recording does not have."""


class SandboxGroup(Group):
    """The group contract answered from a recording: no network, no peers. Collectives and
    receives copy the next recorded output of this slot into the caller's tensor; sends and
    barriers do nothing. ``rewind`` starts the next shadow iteration."""

    def __init__(self, real_like: Group, ops: list[tuple[str, torch.Tensor]]):
        super().__init__(real_like.spec, real_like.generation, real_like.rank, None,
                         real_like.device, sandbox=True)
        self._ops, self._cursor = ops, 0

    def rewind(self) -> None:
        self._cursor = 0

    def load(self, ops: list[tuple[str, torch.Tensor]]) -> None:
        self._ops, self._cursor = ops, 0

    def _next(self, op: str, tensor: torch.Tensor | None) -> torch.Tensor:
        if self._cursor >= len(self._ops):
            raise SandboxMismatch(f"{self.name}: {op} #{self._cursor} is beyond the recording")
        rec_op, value = self._ops[self._cursor]
        if rec_op != op or (tensor is not None and tuple(value.shape) != tuple(tensor.shape)):
            raise SandboxMismatch(
                f"{self.name}: operation #{self._cursor} is {op}{tuple(tensor.shape) if tensor is not None else ''}"
                f" but the recording has {rec_op}{tuple(value.shape)}")
        self._cursor += 1
        return value

    def allreduce(self, tensor, op=None, async_op: bool = False):
        tensor.copy_(self._next("allreduce", tensor))
        return _DoneWork() if async_op else None

    def broadcast(self, tensor, src: int, async_op: bool = False):
        tensor.copy_(self._next("broadcast", tensor))
        return _DoneWork() if async_op else None

    def allgather(self, tensor):
        return [t.to(tensor.device) for t in self._next("allgather", None)]

    def recv(self, tensor, peer: int, tag: int = 0):
        tensor.copy_(self._next("recv", tensor))
        return _DoneWork()

    def send(self, tensor, peer: int, tag: int = 0):
        return _DoneWork()

    def barrier(self) -> None:
        return None


def sandbox_groups(layout: Layout, role: Role, rec: Recording | None,
                   device: torch.device) -> CommGroups:
    """A ``CommGroups`` for ``role`` whose multi-member slots replay ``rec`` (or, with None,
    the recording given later to ``load_into``)."""
    slots = {}
    for slot, spec in layout.groups_of(role).items():
        base = Group(spec, 0, spec.rank_of(role), None, device, sandbox=True)
        ops = rec.ops.get(slot, []) if rec is not None else []
        slots[slot] = SandboxGroup(base, ops) if spec.size > 1 else \
            Group(spec, 0, spec.rank_of(role), None, device)
    return CommGroups(role=role, **slots)


def load_into(groups: CommGroups, rec: Recording) -> None:
    """Give a sandbox built before its recording existed the recorded operations."""
    for slot, g in groups.slots().items():
        if isinstance(g, SandboxGroup):
            g.load(rec.ops.get(slot, []))


def rewind(groups: CommGroups) -> None:
    for g in groups.slots().values():
        if isinstance(g, SandboxGroup):
            g.rewind()
