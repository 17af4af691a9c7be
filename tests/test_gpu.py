"""GPU/NCCL smoke test of the same engine; skipped where CUDA is absent."""
import pytest
import torch

from trainmover.core.events import read_jsonl
from trainmover.control.coordinator import run_job
from trainmover.recipes import get_recipe
from trainmover.core.topology import Layout

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.timeout(600)
def test_nccl_job_matches_cpu(tmp_path):
    dp = min(2, torch.cuda.device_count())
    cfg = get_recipe("tiny")
    cfg.layout = Layout(dp, 1, 1)
    cfg.train.steps = 4
    cpu = run_job(cfg.validate(), str(tmp_path / "cpu"), quiet=True, timeout_s=300)
    cfg.process.device = "cuda"
    gpu = run_job(cfg.validate(), str(tmp_path / "gpu"), quiet=True, timeout_s=300)
    a = read_jsonl(str(tmp_path / "cpu" / "metrics.jsonl"))
    b = read_jsonl(str(tmp_path / "gpu" / "metrics.jsonl"))
    assert len(b) == 4
    for x, y in zip(a, b):  # different kernels: close, not equal
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-3)
    assert gpu["steps"] == cpu["steps"]
