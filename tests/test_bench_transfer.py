"""``trainmover bench transfer``'s small case: the built-in trainer's state of 10 MB sent
whole and as one buffer over one gloo pair, outside a job."""
import json

import pytest

from trainmover.bench.transfer import bench_transfer


@pytest.mark.timeout(240)
def test_the_transfer_of_a_small_state_is_measured_against_one_buffer(tmp_path):
    res = bench_transfer([10], 3, str(tmp_path), "t", "test")
    (row,) = res["rows"]
    # parameters and AdamW's two moments (12 bytes a parameter), plus the small entries
    # the transfer adds: step counts and the generators' states
    assert row["params"] * 12 <= row["state_bytes"] < row["params"] * 12 + 100_000
    assert len(row["runs"]["transfer_s"]) == len(row["runs"]["one_buffer_s"]) == 3
    assert 0 < row["efficiency"]["min"] <= row["efficiency"]["median"]
    assert json.loads((tmp_path / "t.json").read_text())["benchmark"] == "transfer"
    assert "efficiency" in (tmp_path / "t.md").read_text()


def test_a_bad_repeat_count_or_size_is_refused_before_anything_runs(tmp_path):
    with pytest.raises(ValueError, match="--repeats 2"):
        bench_transfer([10], 2, str(tmp_path), "t", "test")
    with pytest.raises(ValueError, match="-5"):
        bench_transfer([-5], 3, str(tmp_path), "t", "test")
    assert list(tmp_path.iterdir()) == []
