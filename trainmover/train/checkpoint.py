"""Checkpoints of the canonical state in ``torch.distributed.checkpoint`` format.

Written to a temporary directory and renamed into place, so a crash mid-write never leaves a
directory that looks complete. Load with ``dcp.load`` into any layout's tensors, or convert
to one ``torch.save`` file with ``dcp_to_torch_save`` (what ``load_canonical`` does).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tempfile
import warnings

import torch

from trainmover.core.files import (COMPLETE, CORRUPT, MANIFEST_VERSION, complete_steps,
                                   entry_path, local_path, read_manifest, step_dir)


PRUNED = ".pruned-"   # a checkpoint folder on its way out


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


# --- per-role local checkpoints -------------------------------------------------------------

class CheckpointCorrupt(ValueError):
    """A checkpoint file does not match its manifest (truncated, altered, or missing)."""


def load_local(run_dir: str, step: int, role_name: str) -> dict[str, torch.Tensor]:
    """A role's state from the step's checkpoint, verified against the manifest (size and
    sha256). A mismatch marks the whole checkpoint ``CORRUPT`` (so no process picks it
    again: the controller falls back to an older one) and raises ``CheckpointCorrupt``."""
    manifest = read_manifest(run_dir, step)
    if manifest is None:
        raise CheckpointCorrupt(f"the step-{step} checkpoint has no readable manifest "
                                f"({step_dir(run_dir, step)}/{COMPLETE})")
    entry = manifest["files"].get(role_name)
    path = local_path(run_dir, step, role_name)
    try:
        with open(path, "rb") as f:
            blob = f.read()
    except OSError as exc:
        blob, why = None, f"{role_name}.pt cannot be read: {exc}"
    if entry is None:
        why = f"the manifest has no file for role {role_name}"
    elif blob is not None and len(blob) != entry["bytes"]:
        why = f"{role_name}.pt has {len(blob)} bytes, the manifest says {entry['bytes']}"
    elif blob is not None and hashlib.sha256(blob).hexdigest() != entry["sha256"]:
        why = f"{role_name}.pt's sha256 differs from the manifest's"
    elif blob is not None:
        return torch.load(io.BytesIO(blob), weights_only=True)
    mark_corrupt(run_dir, step, why)
    raise CheckpointCorrupt(f"step-{step} checkpoint is corrupt: {why}")


def mark_corrupt(run_dir: str, step: int, reason: str) -> None:
    marker = os.path.join(step_dir(run_dir, step), CORRUPT)
    tmp = f"{marker}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(reason + "\n")
    os.replace(tmp, marker)


class _HashingWriter:
    """A file that hashes what is written to it (torch.save writes sequentially), so the
    manifest's sha256 costs no second read."""

    def __init__(self, f):
        self.f, self.sha, self.size = f, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.sha.update(data)
        self.size += len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def _write_json(path: str, obj) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


# --- periodic asynchronous checkpoints (the failure fallback) --------------------------------

class AsyncCheckpointer:
    """Checkpoints one role's local state every few steps without making training wait for
    the disk: at the step boundary the state is copied to host memory (the only synchronous
    part), a background thread writes it (temporary file, then rename), and the role that
    completes a step's set writes its ``COMPLETE`` marker (atomically, last). A crash at any
    point leaves either a complete checkpoint or one that ``latest_complete`` ignores; the
    previous complete one is kept until a newer one is complete. Each file's size and
    sha256 go into the ``COMPLETE`` marker, the checkpoint's manifest, checked on load."""

    def __init__(self, run_dir: str, role_name: str, role_names: list[str], store, keep: int):
        self.run_dir, self.role_name = run_dir, role_name
        self.role_names, self.num_roles = sorted(role_names), len(role_names)
        self.store, self.keep = store, keep
        self._thread = None
        self.on_write = None  # fault-injection hook: called with the path being written
        self.step: int | None = None
        self.saved_step: int | None = None   # the last checkpoint step taken
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
        self.saved_step = step
        self._thread = threading.Thread(target=self._write, args=(step, snapshot, self.epoch),
                                        name=f"ckpt-{step}", daemon=True)
        self._thread.start()
        return time.perf_counter() - t0

    def _write(self, step: int, snapshot: dict, epoch: int) -> None:
        from trainmover.core import protocol as P

        path = local_path(self.run_dir, step, self.role_name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp"
        with open(tmp, "wb") as f:
            out = _HashingWriter(f)
            torch.save(snapshot, out)
        if self.on_write is not None:
            self.on_write(tmp)  # a crash here: the data is on disk but never committed
        os.replace(tmp, path)
        _write_json(entry_path(self.run_dir, step, self.role_name),
                    {"bytes": out.size, "sha256": out.sha.hexdigest(), "epoch": epoch})
        if self.store.add(P.checkpoint_key(epoch, step), 1) == self.num_roles:
            # every role wrote its file and entry in this epoch: gather the manifest
            files = {}
            for role in self.role_names:
                with open(entry_path(self.run_dir, step, role)) as f:
                    entry = json.load(f)
                files[role] = {"bytes": entry["bytes"], "sha256": entry["sha256"]}
            # a step written again (after a rollback) is new: an old verdict is void
            try:
                os.remove(os.path.join(step_dir(self.run_dir, step), CORRUPT))
            except FileNotFoundError:
                pass
            _write_json(os.path.join(step_dir(self.run_dir, step), COMPLETE),
                        {"version": MANIFEST_VERSION, "step": step, "epoch": epoch,
                         "files": files})
            # nobody adds to this count again: every role wrote in this epoch
            self.store.delete_key(P.checkpoint_key(epoch, step))
            self._prune(step)

    def _prune(self, newest: int) -> None:
        """Drop checkpoints older than the last ``keep`` complete ones."""
        complete = complete_steps(self.run_dir)
        keep = set(complete[-self.keep:])
        floor = min(keep) if keep else newest
        root = os.path.join(self.run_dir, "ckpt")
        for name in os.listdir(root):
            if name.startswith(PRUNED):
                # one whose deletion was cut short (the process died meanwhile)
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            elif name.startswith("step") and name[4:].isdigit() and int(name[4:]) < floor:
                # out of sight in one atomic rename, then deleted: no checkpoint is ever
                # half gone under its step's name (one listed just before is gone whole)
                doomed = os.path.join(root, f"{PRUNED}{name}-{os.getpid()}")
                try:
                    os.rename(os.path.join(root, name), doomed)
                except OSError:
                    continue      # another role's checkpointer took it first
                shutil.rmtree(doomed, ignore_errors=True)

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
