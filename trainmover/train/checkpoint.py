"""Checkpoints of the canonical state in ``torch.distributed.checkpoint`` format.

Written to a temporary directory and renamed into place, so a crash mid-write never leaves a
directory that looks complete. Load with ``dcp.load`` into any layout's tensors, or convert
to one ``torch.save`` file with ``dcp_to_torch_save`` (what ``load_canonical`` does).
"""
from __future__ import annotations

import os
import shutil
import tempfile
import warnings

import torch

from trainmover.core.files import COMPLETE, complete_steps, local_path, step_dir


def save_canonical(state: dict[str, torch.Tensor], path: str) -> None:
    import torch.distributed.checkpoint as dcp

    tmp = f"{path}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    with warnings.catch_warnings():  # "assuming ... single process" is exactly the intent
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(dict(state), storage_writer=dcp.FileSystemWriter(tmp), no_dist=True)
    if os.path.exists(path):
        shutil.rmtree(path)
    os.replace(tmp, path)


def load_canonical(path: str) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    if not os.path.exists(os.path.join(path, ".metadata")):
        raise ValueError(f"{path!r} is not a complete checkpoint (no .metadata)")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "state.pt")
        dcp_to_torch_save(path, out)
        return torch.load(out, weights_only=True)


# --- per-role local checkpoints (the restart baseline reloads these) -------------------------



def load_local(run_dir: str, step: int, role_name: str) -> dict[str, torch.Tensor]:
    path = local_path(run_dir, step, role_name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint of role {role_name} before step {step}: {path}")
    return torch.load(path, weights_only=True)


# --- periodic asynchronous checkpoints (the failure fallback) --------------------------------









class AsyncCheckpointer:
    """Checkpoints one role's local state every few steps without making training wait for
    the disk: at the step boundary the state is copied to host memory (the only synchronous
    part), a background thread writes it (temporary file, then rename), and the role that
    completes a step's set writes its ``COMPLETE`` marker (atomically, last). A crash at any
    point leaves either a complete checkpoint or one that ``latest_complete`` ignores; the
    previous complete one is kept until a newer one is complete."""

    def __init__(self, run_dir: str, role_name: str, num_roles: int, store, keep: int):
        self.run_dir, self.role_name, self.num_roles = run_dir, role_name, num_roles
        self.store, self.keep = store, keep
        self._thread = None
        self.on_write = None  # fault-injection hook: called with the path being written
        self.step: int | None = None
        # Completion is counted per epoch: after a rollback the same step is written again,
        # and only a full set written in one epoch may be marked complete.
        self.epoch = 0

    def save(self, step: int, tensors: dict) -> float:
        """Snapshot now, write in the background. Returns the synchronous seconds."""
        import threading
        import time

        t0 = time.perf_counter()
        self.wait()  # at most one write in flight per role
        snapshot = {k: v.detach().to("cpu", copy=True) for k, v in tensors.items()}
        self._thread = threading.Thread(target=self._write, args=(step, snapshot, self.epoch),
                                        name=f"ckpt-{step}", daemon=True)
        self._thread.start()
        return time.perf_counter() - t0

    def _write(self, step: int, snapshot: dict, epoch: int) -> None:
        from trainmover.core import protocol as P

        path = local_path(self.run_dir, step, self.role_name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp"
        torch.save(snapshot, tmp)
        if self.on_write is not None:
            self.on_write(tmp)  # a crash here: the data is on disk but never committed
        os.replace(tmp, path)
        if self.store.add(P.checkpoint_key(epoch, step), 1) == self.num_roles:
            marker = os.path.join(step_dir(self.run_dir, step), COMPLETE)
            with open(f"{marker}.tmp", "w") as f:
                f.write(f"{step}\n")
            os.replace(f"{marker}.tmp", marker)
            self._prune(step)

    def _prune(self, newest: int) -> None:
        """Drop checkpoints older than the last ``keep`` complete ones."""
        complete = complete_steps(self.run_dir)
        keep = set(complete[-self.keep:])
        floor = min(keep) if keep else newest
        root = os.path.join(self.run_dir, "ckpt")
        for name in os.listdir(root):
            if name.startswith("step") and name[4:].isdigit() and int(name[4:]) < floor:
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
