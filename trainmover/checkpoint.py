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
