"""Checkpoints you can trust: every file's size and sha256 in the manifest, checked on load;
a truncated or altered checkpoint is skipped for the next older intact one, in a running job
as well as on disk."""
import os
import signal

import pytest
import torch

from trainmover.api import Job
from trainmover.control.coordinator import run_job
from trainmover.core.events import read_jsonl
from trainmover.core.files import (CORRUPT, check_checkpoint, complete_steps, latest_complete,
                                   local_path, read_manifest, step_dir, usable_checkpoints)
from trainmover.train.checkpoint import AsyncCheckpointer, CheckpointCorrupt, load_local

from mp_harness import wait_for
from test_failures import job

ROLES = ["dp0.pp0.tp0", "dp0.pp1.tp0"]


class CountingStore:
    """The one store operation the checkpointer uses."""

    def __init__(self):
        self.counts = {}

    def add(self, key, n):
        self.counts[key] = self.counts.get(key, 0) + n
        return self.counts[key]

    def delete_key(self, key):
        return self.counts.pop(key, None) is not None


def state(seed):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)}


def write_set(run_dir, step, keep=3, store=None):
    store = store or CountingStore()
    for i, role in enumerate(ROLES):
        ck = AsyncCheckpointer(run_dir, role, ROLES, store, keep)
        ck.save(step, state(step * 10 + i))
        ck.wait()


def flip_a_byte(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))


def test_the_manifest_lists_each_file_with_its_size_and_sha256(tmp_path):
    import hashlib

    run_dir = str(tmp_path)
    write_set(run_dir, 4)
    manifest = read_manifest(run_dir, 4)
    assert sorted(manifest["files"]) == ROLES and manifest["step"] == 4
    for role in ROLES:
        with open(local_path(run_dir, 4, role), "rb") as f:
            blob = f.read()
        assert manifest["files"][role] == {"bytes": len(blob),
                                           "sha256": hashlib.sha256(blob).hexdigest()}
        loaded = load_local(run_dir, 4, role)
        expected = state(40 + ROLES.index(role))
        assert all(torch.equal(loaded[k], expected[k]) for k in expected)
    assert check_checkpoint(run_dir, 4, ROLES) is None
    assert "not the job's" in check_checkpoint(run_dir, 4, ROLES + ["dp1.pp0.tp0"])


def test_a_checkpoint_pruned_while_the_controller_looks_is_not_reported_skipped(
        tmp_path, monkeypatch):
    """The controller lists the complete checkpoints, then checks each; the workers may
    prune an old one in between. It is gone, not damaged: no warning, and the newer ones
    stay usable."""
    from trainmover.core import files

    run_dir = str(tmp_path)
    for step in (0, 3):
        write_set(run_dir, step)
    real_check = files.check_checkpoint

    def check_while_pruning(run_dir_, step, roles=None):
        if step == 0:
            write_set(run_dir, 6, keep=2)       # step 6 completes; the workers drop step 0
        return real_check(run_dir_, step, roles)

    monkeypatch.setattr(files, "check_checkpoint", check_while_pruning)
    usable, skipped = usable_checkpoints(run_dir, ROLES)
    assert skipped == {} and usable == [3]      # as listed before step 6 was complete
    # the pruned folder is deleted, not left aside
    assert sorted(os.listdir(os.path.join(run_dir, "ckpt"))) == ["step3", "step6"]


def test_a_prune_cut_short_is_finished_by_the_next_one(tmp_path):
    from trainmover.train.checkpoint import PRUNED

    run_dir = str(tmp_path)
    write_set(run_dir, 0)
    leftover = os.path.join(run_dir, "ckpt", f"{PRUNED}step0-123")
    os.rename(step_dir(run_dir, 0), leftover)   # as a pruner that died after its rename
    write_set(run_dir, 3, keep=1)
    assert sorted(os.listdir(os.path.join(run_dir, "ckpt"))) == ["step3"]


def test_a_set_missing_a_role_is_not_complete(tmp_path):
    run_dir = str(tmp_path)
    store = CountingStore()
    ck = AsyncCheckpointer(run_dir, ROLES[0], ROLES, store, 2)
    ck.save(2, state(1))
    ck.wait()
    assert complete_steps(run_dir) == [] and latest_complete(run_dir) is None


def test_a_truncated_checkpoint_is_skipped_for_the_older_one(tmp_path):
    run_dir = str(tmp_path)
    write_set(run_dir, 2)
    write_set(run_dir, 4)
    path = local_path(run_dir, 4, ROLES[1])
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 7)
    usable, skipped = usable_checkpoints(run_dir, ROLES)
    assert usable == [2] and "bytes, the manifest says" in skipped[4]
    assert latest_complete(run_dir, ROLES) == 2
    with pytest.raises(CheckpointCorrupt, match="bytes, the manifest says"):
        load_local(run_dir, 4, ROLES[1])


def test_an_altered_file_is_caught_on_load_and_marks_the_checkpoint(tmp_path):
    """Same size, other bytes: only the sha256 tells. The loader marks the checkpoint
    corrupt, so every later choice skips it."""
    run_dir = str(tmp_path)
    write_set(run_dir, 2)
    write_set(run_dir, 4)
    flip_a_byte(local_path(run_dir, 4, ROLES[0]))
    assert latest_complete(run_dir, ROLES) == 4          # the cheap check cannot see it
    assert load_local(run_dir, 4, ROLES[1])              # the intact file still loads
    with pytest.raises(CheckpointCorrupt, match="sha256 differs"):
        load_local(run_dir, 4, ROLES[0])
    assert os.path.exists(os.path.join(step_dir(run_dir, 4), CORRUPT))
    assert latest_complete(run_dir, ROLES) == 2
    assert "marked corrupt" in check_checkpoint(run_dir, 4, ROLES)


def test_only_the_newest_complete_checkpoints_are_kept(tmp_path):
    run_dir = str(tmp_path)
    for step in (2, 4, 6, 8):
        write_set(run_dir, step, keep=2)
    assert complete_steps(run_dir) == [6, 8]
    assert sorted(os.listdir(os.path.join(run_dir, "ckpt"))) == ["step6", "step8"]


# --- in a running job ------------------------------------------------------------------------

EVERY, STEPS = 3, 24


def pp_job():
    """No data-parallel replica: a failure rolls every role back to a checkpoint (the
    in-memory snapshots, which would come first, are off: the disk path is under test)."""
    return job(dp=1, pp=2, tp=1, steps=STEPS, standbys=2, checkpoint_every=EVERY,
               checkpoint_keep=3, snapshot_every=0)


@pytest.fixture(scope="module")
def pp_baseline(tmp_path_factory):
    root = tmp_path_factory.mktemp("pp_baseline")
    return run_job(pp_job(), str(root / "run"), quiet=True, timeout_s=300)["weights_sha256"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("damage", ["failed-role-altered",
                                    pytest.param("survivor-altered", marks=pytest.mark.slow),
                                    "truncated"])
def test_a_corrupt_newest_checkpoint_falls_back_to_the_older_one(tmp_path, pp_baseline,
                                                                  damage):
    """Once the step-9 checkpoint is complete, one of its files is damaged and the worker
    of role dp0.pp1.tp0 is killed. The recovery must not use step 9: a truncated file is
    seen before planning (its size), an altered one only when loaded, by the joiner (the
    failed role's file) or by the survivor (its own), which abandons that plan. Either way
    the job rolls back to step 6 and ends with the uninterrupted run's weights."""
    run_dir = str(tmp_path / "run")
    running = Job(pp_job(), run_dir, timeout_s=280).start()
    wait_for(lambda: 9 in complete_steps(run_dir), 120, "the step-9 checkpoint")
    victim_role, killed = ROLES[1], "w1"
    target = ROLES[0] if damage == "survivor-altered" else victim_role
    path = local_path(run_dir, 9, target)
    if damage == "truncated":
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    else:
        flip_a_byte(path)
    assert complete_steps(run_dir)[-1] == 9, "a newer checkpoint completed meanwhile"
    (pid,) = [e["pid"] for e in read_jsonl(os.path.join(run_dir, "events.jsonl"))
              if e["event"] == "process_started" and e["name"] == killed]
    os.kill(pid, signal.SIGKILL)
    summary = running.wait(290)
    (rec,) = summary["recoveries"]
    assert rec["rollback_step"] == 6 and set(rec["sources"].values()) == {"checkpoint"}
    events = read_jsonl(os.path.join(run_dir, "events.jsonl"))
    reasons = {e["recovery_id"]: e["reason"] for e in events
               if e["event"] == "recovery_abandoned"}
    if damage == "truncated":
        assert rec["abandoned_plans"] == [], reasons
    else:
        # the first plan (step 9) is given up for the damaged file. CI once saw a second
        # plan given up too (on a loaded machine; its reason was not kept): the reasons are
        # in the message now, and what must hold is that step 9 was refused for its file
        assert rec["abandoned_plans"][:1] == [1], reasons
        # the survivor reports its damaged file; a joiner whose file is damaged exits
        why = "sha256 differs" if damage == "survivor-altered" else "died"
        assert why in reasons[1], reasons
    skipped = [e for e in events if e["event"] == "checkpoint_skipped"]
    assert [e["step"] for e in skipped] == [9]
    assert ("bytes, the manifest says" if damage == "truncated" else "sha256 differs") \
        in skipped[0]["reason"]
    assert summary["weights_sha256"] == pp_baseline
