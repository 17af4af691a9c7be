"""Whole jobs: coordinator + worker processes on the built-in corpus."""
import os
import subprocess
import sys

import pytest
import torch

from trainmover.core.events import read_jsonl
from trainmover.train.checkpoint import load_canonical as load_canonical_checkpoint
from trainmover.control.coordinator import run_job
from trainmover.recipes import get_recipe
from trainmover.train.state import state_digest
from trainmover.core.topology import Layout


def tiny(dp=1, pp=1, tp=1, steps=6, **train):
    cfg = get_recipe("tiny")
    cfg.layout = Layout(dp, pp, tp)
    cfg.train.steps = steps
    for k, v in train.items():
        setattr(cfg.train, k, v)
    return cfg.validate()


@pytest.mark.timeout(300)
def test_layouts_train_the_same_model(tmp_path):
    """DP2xPP2xTP2 (8 processes) and one process see the same tokens from the same initial
    weights, so their loss curves agree up to float summation order (TP and DP reductions
    add in a different order): we allow 1e-5 relative, about 100 float32 ulps of a loss near 5."""
    one = run_job(tiny(), str(tmp_path / "one"), quiet=True, timeout_s=120)
    many = run_job(tiny(2, 2, 2), str(tmp_path / "many"), quiet=True, timeout_s=200)
    a = read_jsonl(str(tmp_path / "one" / "metrics.jsonl"))
    b = read_jsonl(str(tmp_path / "many" / "metrics.jsonl"))
    assert [m["step"] for m in a] == [m["step"] for m in b] == list(range(6))
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5, abs=0)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-4)
    assert a[-1]["loss"] < a[0]["loss"]  # it learns
    assert one["layout"] == {"dp": 1, "pp": 1, "tp": 1}
    assert many["layout"] == {"dp": 2, "pp": 2, "tp": 2}
    # the canonical states hold the same tensors, close in value
    sa = load_canonical_checkpoint(one["checkpoint"])
    sb = load_canonical_checkpoint(many["checkpoint"])
    assert sorted(sa) == sorted(sb)
    for name in sa:
        torch.testing.assert_close(sa[name], sb[name], rtol=0, atol=2e-4)


@pytest.mark.timeout(300)
def test_identical_runs_are_bit_identical(tmp_path):
    cfg = tiny(2, 2, 1)
    a = run_job(cfg, str(tmp_path / "a"), quiet=True, timeout_s=120)
    b = run_job(cfg, str(tmp_path / "b"), quiet=True, timeout_s=120)
    assert a["weights_sha256"] == b["weights_sha256"]
    assert a["steps"] == 6 and a["final_loss"] == b["final_loss"]
    # the checkpoint holds exactly the hashed state
    assert state_digest(load_canonical_checkpoint(a["checkpoint"])) == a["weights_sha256"]
    c = run_job(tiny(2, 2, 1, seed=99), str(tmp_path / "c"), quiet=True, timeout_s=120)
    assert c["weights_sha256"] != a["weights_sha256"]
    for name in ("metrics.jsonl", "events.jsonl", "summary.json", "job.json"):
        assert os.path.exists(tmp_path / "a" / name)
    rec = read_jsonl(str(tmp_path / "a" / "metrics.jsonl"))[0]
    assert {"step", "loss", "step_time_s", "tokens_per_s"} <= set(rec)
    events = {e["event"] for e in read_jsonl(str(tmp_path / "a" / "events.jsonl"))}
    assert {"job_started", "worker_started", "groups_built", "engine_ready", "job_done"} <= events


def cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "trainmover", *args], capture_output=True,
                          text=True, timeout=60, cwd=cwd)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args, message", [
    (["--dp", "2", "--workers", "3"], "--workers=3 does not match layout DP2xPP2xTP1"),
    (["--tp", "3"], "n_heads=4 is not divisible by tp=3"),
    (["--pp", "5"], "n_layers=4 is fewer than pipeline stages pp=5"),
    (["--recipe", "nope"], "unknown recipe 'nope'"),
    (["--data", "/no/such/corpus.txt"], "'/no/such/corpus.txt' does not exist"),
    (["--data", "/"], "'/' does not exist or is not a file"),
    (["--dp", "0"], "dp must be a positive integer, got 0"),
    (["--standbys", "500"], "standby.count=500 is more standbys than the job can use"),
    (["--inject", "commerr@3:w1:checkpoint"], "could never fail there"),
    (["--nnodes", "2"], "is loopback, which the other 1 host(s) cannot reach"),
])
def test_bad_input_fails_before_launch(tmp_path, args, message):
    run_dir = tmp_path / "run"
    res = cli("run", "--run-dir", str(run_dir), *args)
    assert res.returncode == 2, res.stderr
    assert message in res.stderr
    assert not run_dir.exists()  # nothing was launched, nothing written


@pytest.mark.timeout(120)
def test_existing_run_dir_is_refused(tmp_path):
    run_job(tiny(steps=1), str(tmp_path / "r"), quiet=True, timeout_s=60)
    res = cli("run", "--recipe", "tiny", "--steps", "1", "--run-dir", str(tmp_path / "r"))
    assert res.returncode == 2 and "already holds a job" in res.stderr


@pytest.mark.timeout(120)
def test_a_run_dir_that_is_a_file_is_refused(tmp_path):
    path = tmp_path / "a-file"
    path.write_text("not a run dir")
    res = cli("run", "--recipe", "tiny", "--steps", "1", "--run-dir", str(path))
    assert res.returncode == 2 and "is a file, not a directory" in res.stderr, res.stderr
    assert path.read_text() == "not a run dir"


@pytest.mark.timeout(120)
def test_user_text_file(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    cfg = tiny(steps=3)
    cfg.data.source = str(corpus)
    summary = run_job(cfg.validate(), str(tmp_path / "r"), quiet=True, timeout_s=60)
    assert summary["steps"] == 3
