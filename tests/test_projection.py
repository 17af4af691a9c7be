"""The cluster-scale projection model (``trainmover project``): its limits, the closed form it
must reproduce, the published trend, and reading costs from bench results. Torch-free."""
import json
import math
import os

import pytest

from trainmover.bench.project import (Cluster, EventCosts, costs_from_bench, erlang_b, project,
                                      restart_ettr, write_projection)
from trainmover.cli import main

DATA = os.path.join(os.path.dirname(__file__), "data")
BENCH = [os.path.join(DATA, "bench_downtime.json"),
         os.path.join(DATA, "bench_downtime-failures.json")]
COSTS = EventCosts(detect_s=1.0, switch_s=0.3, planned_s=0.1, cold_join_s=50.0)


def test_no_failures_and_free_checkpoints_keep_every_hour():
    cluster = Cluster(gpus=[1024, 131072], failures_per_1000_node_days=0.0,
                      checkpoint_write_s=0.0)
    for row in project(cluster, COSTS):
        assert row.ettr == {s: 1.0 for s in row.ettr}
        assert row.out_of_range == []
        assert all(v == 0.0 for v in row.wasted_gpu_h_per_week.values())


def test_no_failures_leaves_only_the_checkpoint_overhead():
    # 36 s blocking every 60 min: 1 / (1 + 0.01) for everyone
    cluster = Cluster(gpus=[4096], failures_per_1000_node_days=0.0, checkpoint_every_min=60,
                      checkpoint_write_s=36.0)
    (row,) = project(cluster, COSTS)
    for v in row.ettr.values():
        assert v == pytest.approx(1 / 1.01, rel=1e-12)


def test_restart_reproduces_the_closed_form():
    # 1,024 GPUs = 128 hosts at 8 per host; 6.5 failures per 1,000 node-days;
    # u0 = 10 min, dt = 60 min, w = 30 s, no planned events:
    # N*r = 128 * 6.5e-3 / 24 per hour = 0.034667 /h; lost = 0.034667 * (1/6 + 1/2) = 0.023111
    # ETTR = (1 - 0.023111) / (1 + (30/3600) / 1) = 0.976889 / 1.008333 = 0.968815
    cluster = Cluster(gpus=[1024], restart_overhead_min=10, checkpoint_every_min=60,
                      checkpoint_write_s=30, planned_per_unplanned=0.0)
    (row,) = project(cluster, COSTS)
    assert row.ettr["restart"] == pytest.approx(0.968815, abs=2e-6)
    assert restart_ettr(128, 6.5e-3 / 24, 10 / 60, 1.0, 30 / 3600) == \
        pytest.approx(0.968815, abs=2e-6)


def test_the_published_trend_for_a_16k_gpu_job():
    """Kokolis et al. (HPCA '25): a 16K-GPU job on RSC-1 goes from ETTR about 0.70 to about
    0.93 when checkpoints go from every 60 min to every 5 min (restart overhead at the low
    end of 5-20 min, a checkpoint write that does not block)."""
    def ettr(every_min):
        cluster = Cluster(gpus=[16384], checkpoint_every_min=every_min, checkpoint_write_s=0.0,
                          restart_overhead_min=5.0, planned_per_unplanned=0.0)
        return project(cluster, COSTS)[0].ettr["restart"]
    assert ettr(60) == pytest.approx(0.70, abs=0.04)
    assert ettr(5) == pytest.approx(0.93, abs=0.02)
    assert ettr(60) < ettr(30) < ettr(15) < ettr(5)


def test_erlang_b_known_values():
    assert erlang_b(0, 3.0) == 1.0
    assert erlang_b(1, 1.0) == pytest.approx(0.5)
    assert erlang_b(2, 1.0) == pytest.approx(0.2)            # (1/2) / (1 + 1 + 1/2)
    assert erlang_b(5, 0.0) == 0.0
    with pytest.raises(ValueError, match="-1"):
        erlang_b(-1, 1.0)


def test_an_empty_pool_costs_cold_joins_and_scale_is_out_of_range_for_restart():
    cluster = Cluster(gpus=[131072], standby_share=0.0, standby_replace_min=6000.0)
    (row,) = project(cluster, COSTS)
    # one standby host, replaced after 100 h, against 8.9 events an hour: almost always busy
    assert row.standby_hosts == 1 and row.no_standby_p > 0.99
    assert row.ettr["trainmover"] == pytest.approx(row.ettr["trainmover_no_standby"], abs=1e-3)
    # 21 s per event (and the same cold joins) costs more than the ~4 s measured here
    assert 0 < row.ettr["trainmover_paper_cost"] < row.ettr["trainmover"] < 1
    # 16,384 hosts * 6.5e-3 / 24 h * (5 min + 15 min) > 1: the restart model breaks down
    assert row.out_of_range == ["restart"] and row.ettr["restart"] == 0.0
    assert row.wasted_gpu_h_per_week["restart"] == 131072 * 168


def test_costs_are_read_from_bench_results():
    costs = costs_from_bench(BENCH)
    with open(BENCH[1]) as f:
        failures = json.load(f)["results"]
    (hang8,) = [r for r in failures if r["scenario"] == "hang" and r["strategy"] == "trainmover"
                and r["workers"] == 8]
    (crash8,) = [r for r in failures if r["scenario"] == "crash" and r["strategy"] ==
                 "trainmover" and r["workers"] == 8]
    assert costs.detect_s == hang8["phases"]["detect_s"]
    assert math.isclose(costs.switch_s, crash8["phases"]["collect_s"] +
                        crash8["phases"]["rebuild_and_first_step_s"])
    assert costs.source["workers"]["planned"] == 8 and costs.source["detect_from"] == "hang"
    with pytest.raises(ValueError, match="no crash result for trainmover"):
        costs_from_bench(BENCH[:1])


def test_project_command_writes_the_table_and_rejects_bad_values(tmp_path, capsys):
    out = tmp_path / "res"
    assert main(["project", *sum((["--bench", b] for b in BENCH), []), "--out", str(out),
                 "--gpus", "1024,8192"]) == 0
    result = json.loads((out / "projection.json").read_text())
    assert [r["gpus"] for r in result["rows"]] == [1024, 8192]
    assert "| 8,192 |" in (out / "projection.md").read_text()
    assert main(["project", "--bench", BENCH[0], "--bench", BENCH[1], "--out", str(out),
                 "--gpus", "1001"]) == 2
    assert "--gpus 1001" in capsys.readouterr().err
    assert main(["project", "--bench", BENCH[0], "--bench", BENCH[1], "--out", str(out),
                 "--link-gb-per-s", "0"]) == 2
    assert "--link-gb-per-s 0" in capsys.readouterr().err
    assert main(["project", "--bench", str(tmp_path / "none.json"), "--out", str(out)]) == 2
    assert "none.json" in capsys.readouterr().err


def test_write_projection_plot(tmp_path):
    pytest.importorskip("matplotlib")
    result = write_projection(Cluster(gpus=[1024, 2048]), COSTS, str(tmp_path))
    with open(result["plot"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_the_projection_does_not_import_torch():
    import subprocess
    import sys

    code = ("import sys, trainmover.bench.project, trainmover.cli; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
