"""The control plane in the projection (``trainmover project --control``): the power-law fits
over a ``bench control`` result and how the projection charges them. Torch-free."""
import dataclasses
import json
import math
import os

import pytest

from trainmover.bench.project import (FLAT, STORE_VOTE, Cluster, EventCosts, project,
                                      write_projection)
from trainmover.bench.scaling import (ControlScaling, PowerLaw, control_from_bench,
                                      fit_power_law, store_vote_from_file)
from trainmover.cli import main

DATA = os.path.join(os.path.dirname(__file__), "data")
BENCH = [os.path.join(DATA, "bench_downtime.json"),
         os.path.join(DATA, "bench_downtime-failures.json")]
COSTS = EventCosts(detect_s=1.0, switch_s=0.3, planned_s=0.1, cold_join_s=50.0,
                   source={"workers": {"switch": 8}})


def constant(value: float) -> PowerLaw:
    return PowerLaw(a=value, b=0.0, points=[[256, value, value], [1024, value, value]])


def scaling(step=0.0, crash=None, store=None, controller=None) -> ControlScaling:
    return ControlScaling(step_overhead_s=constant(step),
                          crash_control_s=crash or constant(0.5),
                          store_cpu=store, controller_cpu=controller,
                          step_overhead_from="mean", source={"file": "x", "repeats": {}})


def control_result(path, rows, benchmark="control"):
    path.write_text(json.dumps({"benchmark": benchmark, "commit": "abc", "results": rows,
                                "settings": {"compute_s": 0.2}}))
    return str(path)


def test_a_power_law_is_recovered_exactly():
    fit = fit_power_law([(n, 2.0 * n ** 1.5) for n in (256, 512, 1024, 2048)], "y")
    assert fit.a == pytest.approx(2.0) and fit.b == pytest.approx(1.5)
    assert all(m == pytest.approx(f) for _, m, f in fit.points)
    assert fit(4096) == pytest.approx(2.0 * 4096 ** 1.5)
    assert (fit.n_min, fit.n_max) == (256, 2048)


def test_the_fit_is_least_squares_on_the_logs():
    # log y = 0, 1, 1 at log N = 0, 1, 2 (base e): slope 0.5, intercept 1/6
    e = math.e
    fit = fit_power_law([(1, 1.0), (e, e), (e * e, e)], "y")
    assert fit.b == pytest.approx(0.5) and math.log(fit.a) == pytest.approx(1 / 6)


def test_a_fit_needs_two_sizes_and_positive_values():
    with pytest.raises(ValueError, match="step overhead: measured at 1 size"):
        fit_power_law([(256, 1.0), (256, 2.0)], "step overhead")
    with pytest.raises(ValueError, match=r"positive.*\(1024, 0.0\)"):
        fit_power_law([(256, 1.0), (1024, 0.0)], "crash")


def test_the_step_overhead_is_charged_on_every_step():
    cluster = Cluster(gpus=[1024, 16384], step_s=5.0)
    flat = project(cluster, COSTS)
    fitted = project(cluster, COSTS, scaling(step=0.25))
    for a, b in zip(flat, fitted):
        assert b.ettr[FLAT] == a.ettr["trainmover"]
        assert b.ettr["trainmover"] == pytest.approx(a.ettr["trainmover"] * 5.0 / 5.25)
        assert b.ettr["restart"] == a.ettr["restart"]
        assert b.control["step_overhead_s"] == pytest.approx(0.25)


def test_the_crash_path_grows_over_the_size_the_events_were_measured_at():
    # c(N) = 1 ms x N: at 16,384 GPUs a failure costs 16.384 - 0.008 s more than at 8 workers
    crash = PowerLaw(a=1e-3, b=1.0, points=[[256, 0.256, 0.256], [1024, 1.024, 1.024]])
    cluster = Cluster(gpus=[16384])
    (row,) = project(cluster, COSTS, scaling(crash=crash))
    extra = 16.384 - 0.008
    assert row.control["crash_control_extra_s"] == pytest.approx(extra)
    slower = dataclasses.replace(COSTS, switch_s=COSTS.switch_s + extra)
    (same,) = project(cluster, slower)
    assert row.ettr["trainmover"] == pytest.approx(same.ettr["trainmover"])
    assert row.ettr["trainmover"] < row.ettr[FLAT]


def test_rows_beyond_the_measured_sizes_are_marked_and_saturation_is_out_of_range(tmp_path):
    # the controller's share: 0.25 at 1,024, a whole core at 4,096 and beyond
    ctl = PowerLaw(a=0.25 / 1024, b=1.0, points=[[256, 0.0625, 0.0625], [1024, 0.25, 0.25]])
    cluster = Cluster(gpus=[1024, 2048, 4096, 8192])
    rows = project(cluster, COSTS, scaling(controller=ctl))
    assert [r.control["extrapolated_x"] for r in rows] == [None, 2, 4, 8]
    assert [r.control["saturated"] for r in rows] == [[], [], ["controller"], ["controller"]]
    for r in rows[2:]:
        assert r.ettr["trainmover"] == r.ettr["trainmover_no_standby"] == 0.0
        assert {"trainmover", "trainmover_no_standby"} <= set(r.out_of_range)
        assert r.ettr[FLAT] > 0.9 and FLAT not in r.out_of_range
    assert rows[1].ettr["trainmover"] > 0.9
    result = write_projection(cluster, COSTS, str(tmp_path), control=scaling(controller=ctl))
    table = (tmp_path / "projection.md").read_text()
    assert "extrapolated x4; controller saturated" in table
    assert "two sizes: the line goes through both" in table
    assert result["strategies"][-1] == FLAT


def test_control_costs_are_read_from_a_bench_control_result(tmp_path):
    rows = [{"workers": n, "vote_p50_ms": p50, "vote_mean_ms": mean, "crash_to_resumed_s": c,
             "store_cpu_share": 0.1, "controller_cpu_share": None}
            for n, p50, mean, c in ((256, 10, 12, 0.3), (256, 20, 14, 0.5),
                                    (256, 30, 40, 0.4), (1024, 40, 48, 1.6))]
    control = control_from_bench(control_result(tmp_path / "c.json", rows))
    # per-size medians: the mean where the result has it
    assert control.step_overhead_from == "mean"
    assert [p[:2] for p in control.step_overhead_s.points] == [[256, 0.014], [1024, 0.048]]
    assert [p[:2] for p in control.crash_control_s.points] == [[256, 0.4], [1024, 1.6]]
    assert control.crash_control_s.b == pytest.approx(1.0)
    assert control.store_cpu.b == pytest.approx(0.0) and control.controller_cpu is None
    # an older result without the mean: the median, said so
    for r in rows:
        del r["vote_mean_ms"]
    old = control_from_bench(control_result(tmp_path / "old.json", rows))
    assert old.step_overhead_from == "p50"
    assert [p[:2] for p in old.step_overhead_s.points] == [[256, 0.02], [1024, 0.04]]


def test_project_command_rejects_bad_control_files(tmp_path, capsys):
    bench = sum((["--bench", b] for b in BENCH), [])
    out = str(tmp_path / "res")
    one = control_result(tmp_path / "one.json", [{"workers": 256, "vote_mean_ms": 5.0,
                                                  "crash_to_resumed_s": 0.3}])
    assert main(["project", *bench, "--control", one, "--out", out]) == 2
    assert "one.json" in capsys.readouterr().err
    other = control_result(tmp_path / "other.json", [], benchmark="downtime")
    assert main(["project", *bench, "--control", other, "--out", out]) == 2
    assert "not a `trainmover bench control` result" in capsys.readouterr().err
    good = control_result(tmp_path / "good.json", [
        {"workers": n, "vote_mean_ms": 0.01 * n, "crash_to_resumed_s": 0.001 * n}
        for n in (256, 1024)])
    assert main(["project", *bench, "--control", good, "--out", out, "--gpus", "1024"]) == 0
    result = json.loads((tmp_path / "res" / "projection.json").read_text())
    assert result["control"]["step_overhead_s"]["b"] == pytest.approx(1.0)
    assert result["rows"][0]["control"]["step_overhead_s"] == pytest.approx(0.01024)


def vote_result(path, rows, benchmark="vote_hosts"):
    path.write_text(json.dumps({"benchmark": benchmark, "commit": "def", "voters_per_host": 8,
                                "rows": rows}))
    return str(path)


def vote_row(hosts, all_ms, spread_ms=0.0, wait_get=False):
    return {"hosts": hosts, "workers": 8 * hosts, "spread_ms": spread_ms, "wait_get": wait_get,
            "all_ms": {"median": all_ms, "min": all_ms, "max": all_ms}}


def test_the_store_vote_column_charges_each_step_the_stores_measured_share(tmp_path):
    """A vote_hosts result (votes sent at once, the relay as it is) fitted against the
    workers; its column charges every step that instead of the simulator's overhead; the
    spread rows and the old wait-then-read rows are not read."""
    path = vote_result(tmp_path / "v.json", [
        vote_row(128, 4.0), vote_row(2048, 64.0), vote_row(2048, 1.0, spread_ms=20.0),
        vote_row(2048, 999.0, wait_get=True)])
    vote, source = store_vote_from_file(path)
    assert [p[:2] for p in vote.points] == [[1024, 0.004], [16384, 0.064]]
    assert vote.b == pytest.approx(1.0)
    assert source["hosts"] == [128, 2048] and source["voters_per_host"] == 8
    control = scaling(step=2.5)
    control.store_vote_s, control.store_vote_source = vote, source
    cluster = Cluster(gpus=[16384, 32768], step_s=5.0)
    rows = project(cluster, COSTS, control)
    for r, v in zip(rows, (0.064, 0.128)):
        assert r.control["store_vote_s"] == pytest.approx(v)
        assert r.ettr[STORE_VOTE] == pytest.approx(r.ettr[FLAT] * 5.0 / (5.0 + v))
        assert r.ettr["trainmover"] == pytest.approx(r.ettr[FLAT] * 5.0 / 7.5)
    assert rows[0].control["store_vote_extrapolated_x"] is None
    assert rows[1].control["store_vote_extrapolated_x"] == pytest.approx(2.0)
    result = write_projection(cluster, COSTS, str(tmp_path), control=control)
    assert result["strategies"][-1] == STORE_VOTE
    table = (tmp_path / "projection.md").read_text()
    assert "the vote alone 128 ms/step (extrapolated x2.0)" in table
    assert "1,024: 4.0 vs 4.0, 16,384: 64.0 vs 64.0 ms" in table


def test_a_vote_groups_result_is_fitted_over_its_grouped_rows_where_the_agent_groups(
        tmp_path):
    """A vote_groups result: the grouped vote's time to every host, from 64 hosts (below,
    the agent votes flat), the flat rows beside it not read."""
    def row(hosts, grouped_ms, flat_ms):
        return {"hosts": hosts, "workers": 8 * hosts,
                "grouped": {"all_ms": {"median": grouped_ms, "min": grouped_ms,
                                       "max": grouped_ms}},
                "flat": {"all_ms": {"median": flat_ms, "min": flat_ms, "max": flat_ms}}}

    path = vote_result(tmp_path / "g.json", [row(16, 1.0, 0.5), row(128, 2.0, 6.0),
                                            row(2048, 8.0, 90.0)], benchmark="vote_groups")
    vote, source = store_vote_from_file(path)
    assert [p[:2] for p in vote.points] == [[1024, 0.002], [16384, 0.008]]
    assert source["benchmark"] == "vote_groups" and source["hosts"] == [128, 2048]
    control = scaling(step=2.5)
    control.store_vote_s, control.store_vote_source = vote, source
    result = write_projection(Cluster(gpus=[16384], step_s=5.0), COSTS, str(tmp_path),
                              control=control)
    assert result["rows"][0]["control"]["store_vote_s"] == pytest.approx(0.008)
    assert "through vote groups (`benchmarks/vote_groups.py`" in \
        (tmp_path / "projection.md").read_text()
    only_small = vote_result(tmp_path / "s.json", [row(16, 1.0, 0.5)], benchmark="vote_groups")
    with pytest.raises(ValueError, match="s.json.*no grouped rows from 64 hosts"):
        store_vote_from_file(only_small)


def test_project_command_rejects_bad_vote_hosts_files(tmp_path, capsys):
    bench = sum((["--bench", b] for b in BENCH), [])
    out = str(tmp_path / "res")
    good = control_result(tmp_path / "good.json", [
        {"workers": n, "vote_mean_ms": 0.01 * n, "crash_to_resumed_s": 0.001 * n}
        for n in (256, 1024)])
    votes = vote_result(tmp_path / "votes.json", [vote_row(128, 4.0), vote_row(2048, 64.0)])
    assert main(["project", *bench, "--vote-hosts", votes, "--out", out]) == 2
    assert "needs --control" in capsys.readouterr().err
    spread = vote_result(tmp_path / "spread.json", [vote_row(128, 4.0, spread_ms=20.0)])
    assert main(["project", *bench, "--control", good, "--vote-hosts", spread,
                 "--out", out]) == 2
    assert "spread.json" in capsys.readouterr().err
    other = vote_result(tmp_path / "other.json", [vote_row(128, 4.0)], benchmark="control")
    assert main(["project", *bench, "--control", good, "--vote-hosts", other,
                 "--out", out]) == 2
    assert "other.json" in capsys.readouterr().err
    assert main(["project", *bench, "--control", good, "--vote-hosts", votes, "--out", out,
                 "--gpus", "16384"]) == 0
    result = json.loads((tmp_path / "res" / "projection.json").read_text())
    assert result["rows"][0]["control"]["store_vote_s"] == pytest.approx(0.064)
