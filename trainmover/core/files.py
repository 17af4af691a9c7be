"""Where a job keeps its files in the run directory, and the pure readers of them that the
controller needs (no torch: the controller never touches tensors).

- ``ckpt/step<K>/<role>.pt``: a role's local state taken before step K; ``COMPLETE`` in the
  folder once every role wrote its file in one epoch (written last, atomically);
- ``final/digest.json``: the job's final ``weights_sha256`` and where its checkpoint is.
"""
from __future__ import annotations

import json
import os

COMPLETE = "COMPLETE"
DIGEST_FILE = "digest.json"


def step_dir(run_dir: str, step: int) -> str:
    return os.path.join(run_dir, "ckpt", f"step{step}")


def local_path(run_dir: str, step: int, role_name: str) -> str:
    return os.path.join(step_dir(run_dir, step), f"{role_name}.pt")


def complete_steps(run_dir: str) -> list[int]:
    root = os.path.join(run_dir, "ckpt")
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        if name.startswith("step") and name[4:].isdigit() and \
                os.path.exists(os.path.join(root, name, COMPLETE)):
            out.append(int(name[4:]))
    return sorted(out)


def latest_complete(run_dir: str) -> int | None:
    """The newest checkpoint every role finished writing, or None."""
    steps = complete_steps(run_dir)
    return steps[-1] if steps else None


def final_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "final")


def read_digest(run_dir: str) -> dict | None:
    """The final state's digest, once the job's worker assembled it (else None)."""
    path = os.path.join(final_dir(run_dir), DIGEST_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)
