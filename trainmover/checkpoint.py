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

def local_path(run_dir: str, step: int, role_name: str) -> str:
    return os.path.join(run_dir, "ckpt", f"step{step}", f"{role_name}.pt")


def save_local(run_dir: str, step: int, role_name: str, tensors: dict, keep: int = 2) -> float:
    """Save one role's local state as the state *before* ``step`` (write, then rename), and
    drop this role's checkpoints older than the last ``keep``. Returns seconds taken."""
    import time

    t0 = time.perf_counter()
    path = local_path(run_dir, step, role_name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp"
    torch.save({k: v.detach().cpu() for k, v in tensors.items()}, tmp)
    os.replace(tmp, path)
    old = local_path(run_dir, step - keep, role_name)
    if os.path.exists(old):
        os.remove(old)
    return time.perf_counter() - t0


def load_local(run_dir: str, step: int, role_name: str) -> dict[str, torch.Tensor]:
    path = local_path(run_dir, step, role_name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint of role {role_name} before step {step}: {path}")
    return torch.load(path, weights_only=True)
