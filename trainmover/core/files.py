"""Where a job keeps its files in the run directory, and the pure readers of them that the
controller needs (no torch: the controller never touches tensors).

- ``ckpt/step<K>/<role>.pt``: a role's local state taken before step K (``step0``: the
  initial state), with ``<role>.json`` beside it (the file's size and sha256);
  ``COMPLETE`` in the folder once every role wrote its file in one epoch (written last,
  atomically): the checkpoint's manifest, every role's file with its size and sha256;
  ``CORRUPT`` if a loader found a file that does not match the manifest (its reason);
- ``final/digest.json``: the job's final ``weights_sha256`` and where its checkpoint is.
"""
from __future__ import annotations

import json
import os

COMPLETE = "COMPLETE"
CORRUPT = "CORRUPT"
DIGEST_FILE = "digest.json"
MANIFEST_VERSION = 1


def step_dir(run_dir: str, step: int) -> str:
    return os.path.join(run_dir, "ckpt", f"step{step}")


def local_path(run_dir: str, step: int, role_name: str) -> str:
    return os.path.join(step_dir(run_dir, step), f"{role_name}.pt")


def entry_path(run_dir: str, step: int, role_name: str) -> str:
    """The role file's manifest entry, written beside it by its writer."""
    return os.path.join(step_dir(run_dir, step), f"{role_name}.json")


def complete_steps(run_dir: str) -> list[int]:
    """Steps whose checkpoint folder has a ``COMPLETE`` marker, oldest first (whether its
    files are intact is ``check_checkpoint``'s question)."""
    root = os.path.join(run_dir, "ckpt")
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        if name.startswith("step") and name[4:].isdigit() and \
                os.path.exists(os.path.join(root, name, COMPLETE)):
            out.append(int(name[4:]))
    return sorted(out)


def read_manifest(run_dir: str, step: int) -> dict | None:
    """The step's manifest (``{"version", "step", "epoch", "files": {role: {"bytes",
    "sha256"}}}``), or None if there is none or it cannot be read."""
    try:
        with open(os.path.join(step_dir(run_dir, step), COMPLETE)) as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("version") != MANIFEST_VERSION or \
            manifest.get("step") != step or not isinstance(manifest.get("files"), dict):
        return None
    return manifest


def check_checkpoint(run_dir: str, step: int, roles: list[str] | None = None) -> str | None:
    """Why the step's checkpoint cannot be used, or None if it looks intact: a manifest that
    names ``roles`` (when given), each file present with the manifest's size, no ``CORRUPT``
    marker. Cheap (no file is read): the sha256 is checked by whoever loads a file."""
    folder = step_dir(run_dir, step)
    corrupt = os.path.join(folder, CORRUPT)
    if os.path.exists(corrupt):
        with open(corrupt) as f:
            return f"marked corrupt: {f.read().strip()[:200]}"
    manifest = read_manifest(run_dir, step)
    if manifest is None:
        return "no readable manifest (incomplete)"
    files = manifest["files"]
    if roles is not None and sorted(files) != sorted(roles):
        return f"its roles {sorted(files)} are not the job's {sorted(roles)}"
    for role, entry in sorted(files.items()):
        path = os.path.join(folder, f"{role}.pt")
        try:
            size = os.path.getsize(path)
        except OSError:
            return f"{role}.pt is missing"
        if size != entry.get("bytes"):
            return f"{role}.pt has {size} bytes, the manifest says {entry.get('bytes')}"
    return None


def usable_checkpoints(run_dir: str, roles: list[str] | None = None
                       ) -> tuple[list[int], dict[int, str]]:
    """The complete checkpoints that look intact (oldest first), and why each other
    complete one is skipped."""
    usable, skipped = [], {}
    for step in complete_steps(run_dir):
        why = check_checkpoint(run_dir, step, roles)
        if why is None:
            usable.append(step)
        elif os.path.exists(os.path.join(step_dir(run_dir, step), COMPLETE)):
            skipped[step] = why
        # else: pruned (an older one the workers dropped) between the listing and the check
    return usable, skipped


def latest_complete(run_dir: str, roles: list[str] | None = None) -> int | None:
    """The newest checkpoint every role finished writing whose files look intact, or None."""
    usable, _ = usable_checkpoints(run_dir, roles)
    return usable[-1] if usable else None


def final_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "final")


def read_digest(run_dir: str) -> dict | None:
    """The final state's digest, once the job's worker assembled it (else None)."""
    path = os.path.join(final_dir(run_dir), DIGEST_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)
