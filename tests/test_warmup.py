"""Record/replay and the sandboxed warm-up of general standbys."""
import os
import shutil

import pytest
import torch

from trainmover.control.coordinator import run_job
from trainmover.train.data import BatchSource, load_tokens
from trainmover.train.engine import Engine
from trainmover.core.events import read_jsonl
from trainmover.core.faults import Inject
from trainmover.comm.record import (RecordingInvalid, SandboxMismatch, load_recording, manifest_for,
                               recording_path, representative_roles, rewind, sandbox_groups,
                               structure_key)
from trainmover.recipes import get_recipe
from trainmover.core.topology import Layout, Role


def job(dp, pp, tp, steps, standbys, **settings):
    """``settings``: ``JobConfig.override`` names (``standby_record=False``)."""
    cfg = get_recipe("tiny")
    cfg.layout = Layout(dp, pp, tp)
    cfg.train.steps = steps
    cfg.train.threads_per_worker = 1
    return cfg.override(standby_count=standbys, **settings).validate()


def test_representative_roles_cover_every_stage_structure():
    assert list(representative_roles(Layout(1, 1, 1), 4)) == ["only-4"]
    assert representative_roles(Layout(2, 2, 2), 4) == {"first-2": Role(0, 0, 0),
                                                        "last-2": Role(0, 1, 0)}
    # 7 layers over 4 stages: 2, 2, 2, 1 -> one middle structure
    assert list(representative_roles(Layout(1, 4, 1), 7)) == ["first-2", "last-1", "middle-2"]
    # 8 layers over 5 stages: 2, 2, 2, 1, 1 -> two middle structures, warmed last
    roles = representative_roles(Layout(1, 5, 1), 8)
    assert list(roles) == ["first-2", "last-1", "middle-2", "middle-1"]
    assert roles["middle-1"] == Role(0, 3, 0)
    assert structure_key(Layout(1, 5, 1), 8, 2) == "middle-2"


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A DP2xPP3xTP2 job with a standby: its representative roles record step 0."""
    run_dir = str(tmp_path_factory.mktemp("rec") / "run")
    cfg = job(2, 3, 2, 3, 1)
    run_job(cfg, run_dir, quiet=True, timeout_s=300)
    return cfg, run_dir


def test_shadow_step_reproduces_the_recorded_loss_exactly(recorded):
    cfg, run_dir = recorded
    events = [e for e in read_jsonl(os.path.join(run_dir, "events.jsonl"))
              if e["event"] == "recorded"]
    assert {e["structure"] for e in events} == {"first-2", "middle-1", "last-1"}
    assert all(e["bytes"] > 0 for e in events)
    metrics = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers ran: bit-exactness needs the same kernels
    try:
        data = load_tokens(cfg.data)
        for key, role in representative_roles(cfg.layout, cfg.model.n_layers).items():
            rec = load_recording(recording_path(os.path.join(run_dir, "recordings"), key),
                                 manifest_for(cfg, key, role))
            groups = sandbox_groups(cfg.layout, role, rec, torch.device("cpu"))
            batches = BatchSource(data, cfg.model.seq_len, cfg.train.global_batch,
                                  cfg.train.seed, cfg.model.vocab_size)
            engine = Engine(cfg, role, groups, batches, torch.device("cpu"))
            result = engine.train_step(0)
            # the replayed grad-norm reductions give the job's own norm, bit for bit
            assert result.grad_norm == metrics[0]["grad_norm"], key
            if key.startswith("last"):
                assert result.loss == metrics[0]["loss"] == rec.manifest["loss"]
            rewind(groups)
            again = engine.train_step(1)  # a second shadow step runs on the same recording
            assert again.grad_norm == result.grad_norm
            rewind(groups)
            with pytest.raises(SandboxMismatch, match="beyond the recording"):
                _overrun(groups)
    finally:
        torch.set_num_threads(threads)


def _overrun(groups):
    """Replay every recorded TP operation, then one more."""
    g = groups.tp
    for i in range(len(g._ops) + 1):
        op, value = g._ops[min(i, len(g._ops) - 1)]
        assert op == "allreduce"
        g.allreduce(torch.zeros_like(value))


def test_stale_or_broken_recordings_are_rejected(recorded, tmp_path):
    cfg, run_dir = recorded
    key, role = "last-1", Role(0, 2, 0)
    src = recording_path(os.path.join(run_dir, "recordings"), key)
    expected = manifest_for(cfg, key, role)
    with pytest.raises(RecordingInvalid, match="no recording"):
        load_recording(str(tmp_path / "none.pt"), expected)
    truncated = tmp_path / "trunc.pt"
    truncated.write_bytes(open(src, "rb").read()[:1000])
    with pytest.raises(RecordingInvalid, match="unreadable"):
        load_recording(str(truncated), expected)
    other = dict(expected, layout={"dp": 1, "pp": 3, "tp": 2})
    with pytest.raises(RecordingInvalid, match="made for layout="):
        load_recording(src, other)
    with pytest.raises(RecordingInvalid, match="code_version"):
        load_recording(src, dict(expected, code_version="0" * 16))


# the default suite checks the same (each joiner warmed every structure, a first, a middle
# and a last stage's role moved, bit-identical) in test_migration's stage-kind test
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_promotion_after_warm_up_into_each_stage_kind_is_bit_identical(tmp_path):
    cfg = job(1, 3, 2, 36, 3)
    names = {cfg.layout.role_of(i).name: f"w{i}" for i in range(cfg.layout.num_roles)}
    targets = [names["dp0.pp0.tp1"], names["dp0.pp1.tp0"], names["dp0.pp2.tp1"]]
    injects = [Inject("migrate", s, t) for s, t in zip((8, 10, 12), targets)]
    base = run_job(cfg, str(tmp_path / "base"), quiet=True, timeout_s=300)
    moved = run_job(cfg, str(tmp_path / "moved"), quiet=True, timeout_s=300, injects=injects)
    done = [m for m in moved["migrations"] if m["status"] == "done"]
    assert [m["pairs"][0]["leaver"] for m in done] == targets
    assert moved["weights_sha256"] == base["weights_sha256"]
    check_joiners_warmed(str(tmp_path / "moved"), done, {"first-2", "middle-1", "last-1"})


def check_joiners_warmed(run_dir: str, migrations: list, structures: set) -> None:
    """Each migration's joiner had warmed up into every one of ``structures`` before it said
    it was ready."""
    events = read_jsonl(os.path.join(run_dir, "events.jsonl"))
    for m in migrations:
        joiner = m["pairs"][0]["joiner"]
        mine = [e for e in events if e.get("worker") == joiner]
        ready = next(i for i, e in enumerate(mine) if e["event"] == "joiner_ready")
        warmed = {e["structure"] for e in mine[:ready] if e["event"] == "warmed"}
        assert warmed == structures, (joiner, warmed)


@pytest.mark.slow   # in `make test-slow`: a sibling in the default suite covers its mechanism
@pytest.mark.timeout(400)
def test_corrupt_and_stale_recordings_fall_back_to_a_cold_standby(recorded, tmp_path):
    """Standbys given a truncated recording (first stage) and another job's recordings
    (the rest) warm nothing they cannot trust, say so, and the result is unaffected."""
    cfg0, run_dir0 = recorded
    bad = tmp_path / "bad-recordings"
    shutil.copytree(os.path.join(run_dir0, "recordings"), bad)
    first = bad / "first-2.pt"
    first.write_bytes(first.read_bytes()[:2000])
    # another job's recordings under this job's structure names: stale, not missing
    os.replace(bad / "middle-1.pt", bad / "middle-2.pt")
    os.replace(bad / "last-1.pt", bad / "last-2.pt")
    # a different job: 6 layers instead of 4 makes every other recording stale
    cfg = job(2, 3, 2, 24, 1, standby_record=False, standby_recording_dir=str(bad))
    cfg.model.n_layers = 6
    cfg.validate()
    ref = job(2, 3, 2, 24, 1, standby_record=False)
    ref.model.n_layers = 6
    base = run_job(ref.validate(), str(tmp_path / "base"), quiet=True, timeout_s=300)
    moved = run_job(cfg, str(tmp_path / "moved"), quiet=True, timeout_s=300,
                    injects=[Inject("migrate", 6, "w3")])
    assert moved["migrations"][0]["status"] == "done"
    assert moved["weights_sha256"] == base["weights_sha256"]
    events = read_jsonl(str(tmp_path / "moved" / "events.jsonl"))
    skipped = [e for e in events if e["event"] == "warmup_skipped"]
    reasons = " ".join(e["reason"] for e in skipped)
    assert "unreadable" in reasons
    assert "was made for structure='middle-1'" in reasons or "was made for model=" in reasons
    assert len(skipped) == 3
    assert not [e for e in events if e["event"] == "warmed"]
