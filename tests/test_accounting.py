"""The downtime maths on synthetic step-end times (``core/accounting.py``): torch-free."""
import pytest

from trainmover.core.accounting import downtime_from_metrics, slowest_stayer, stayer_downtime


def ends_from_gaps(t0: float, gaps: list[float]) -> list[float]:
    """Step 0 ends at ``t0``; step ``s`` takes ``gaps[s - 1]``."""
    out = [t0]
    for g in gaps:
        out.append(out[-1] + g)
    return out


def test_a_stall_at_the_switch_step_is_the_downtime():
    # phase 1 begins at step 6, the switch at step 10 (a 0.25 s stall); normal steps of
    # 0.1 s before phase 1, 0.12 s during it (background preparation)
    gaps = [0.1] * 5 + [0.12] * 4 + [0.35] + [0.1] * 5
    ends = ends_from_gaps(100.0, gaps)       # ends[i]: step i ended
    down, normal, noise = stayer_downtime(0, 6, 10, ends, after=2, baseline=5)
    assert normal == pytest.approx(0.1)
    assert down == pytest.approx(0.25)
    assert noise == pytest.approx(0.0)


def test_a_stall_hidden_in_the_step_after_the_switch_is_counted():
    # the switch step itself looks normal; the step after it (a joiner's slow first
    # backward) takes 0.9 s: the reporter's one gap would see nothing
    gaps = [0.1] * 9 + [0.1, 0.9, 0.1, 0.1]
    ends = ends_from_gaps(0.0, gaps)
    down, normal, _ = stayer_downtime(0, 6, 10, ends, after=2, baseline=5)
    assert down == pytest.approx(0.8)
    records = [{"step": s, "time": t} for s, t in enumerate(ends)]
    reporter, _ = downtime_from_metrics(records, 10)
    assert reporter == pytest.approx(0.0, abs=1e-9)


def test_normal_comes_from_before_phase_one_and_noise_is_its_spread():
    # during phase 1 steps take 0.3 s: measured against those, a 0.2 s stall would vanish
    gaps = [0.1, 0.12, 0.08, 0.1] + [0.3] * 5 + [0.5, 0.1, 0.1]
    ends = ends_from_gaps(0.0, gaps)
    down, normal, noise = stayer_downtime(0, 5, 10, ends, after=2, baseline=5)
    assert normal == pytest.approx(0.1)
    assert noise == pytest.approx(0.04)
    assert down == pytest.approx(0.5 + 0.1 + 0.1 - 3 * 0.1)


def test_a_negative_downtime_is_reported_as_measured():
    gaps = [0.1] * 9 + [0.09, 0.09, 0.09]
    down, _, _ = stayer_downtime(0, 6, 10, ends_from_gaps(0.0, gaps), after=2, baseline=5)
    assert down == pytest.approx(-0.03)


def test_missing_steps_give_no_account():
    ends = ends_from_gaps(0.0, [0.1] * 12)
    # no step ended before phase 1: nothing to call normal
    assert stayer_downtime(6, 6, 10, ends[6:], after=2, baseline=5) is None
    # the steps after the switch have not all ended
    assert stayer_downtime(0, 6, 10, ends[:12], after=2, baseline=5) is None


def test_the_slowest_stayer_sets_the_job_downtime():
    assert slowest_stayer({}) is None
    got = slowest_stayer({"w0": (0.02, 0.1, 0.01), "w2": (0.31, 0.11, 0.02),
                          "w3": (-0.01, 0.1, 0.01)})
    assert got == ("w2", 0.31, 0.11, 0.02)


# --- the benchmark's summary of repeated runs (bench/downtime.py) ---------------------------------

def _row(scenario, strategy, workers, downtime, noise=None, normal=0.1, rep=0):
    return {"scenario": scenario, "strategy": strategy, "workers": workers, "repeat": rep,
            "compile": workers <= 8, "downtime_s": downtime, "downtime_noise_s": noise,
            "normal_step_s": normal, "phases": {"x_s": 1.0}, "groups_rebuilt": None,
            "transfer_bytes": 1_000_000 if strategy == "trainmover" else None}


def test_cells_ratios_and_growth_from_repeats():
    from trainmover.bench.downtime import downtime_result, downtime_table

    rows = [_row("crash", "trainmover", 4, d, rep=i) for i, d in enumerate([0.2, 0.3, 0.25])]
    rows += [_row("crash", "restart", 4, d, rep=i) for i, d in enumerate([15.0, 16.0, 14.0])]
    rows += [_row("crash", "trainmover", 8, d, normal=0.2, rep=i)
             for i, d in enumerate([0.5, 0.6, 0.4])]
    rows += [_row("planned", "trainmover", 4, d, noise=0.05, rep=i)
             for i, d in enumerate([0.02, 0.03, 0.025])]
    rows += [_row("planned", "restart", 4, d, rep=i) for i, d in enumerate([20.0, 21.0, 22.0])]
    rows += [_row("planned", "naive", 4, d, rep=i) for i, d in enumerate([10.0, 50.0, 20.0])]
    rows += [_row("planned", "naive", 4, None, rep=3) | {"error": "boom"}]
    # 8 workers: a planned restart grows; trainmover's migration is inside the noise there
    rows += [_row("planned", "restart", 8, d, rep=i) for i, d in enumerate([40.0, 42.0, 44.0])]
    rows += [_row("planned", "trainmover", 8, d, noise=0.05, rep=i)
             for i, d in enumerate([-0.01, 0.02, 0.01])]
    # 16 workers: a measurable stall, 25x its physical limit
    rows += [_row("planned", "trainmover", 16, d, noise=0.05, rep=i)
             for i, d in enumerate([0.2, 0.3, 0.25])]
    limit = {"bytes": 1_000_000, "seconds": 0.01}
    r = downtime_result(rows, {"event_step": 8, "repeats": 3, "compile": True,
                               "compile_up_to": 8}, "/tmp/x", {4: limit, 16: limit})
    cell = {(c["scenario"], c["workers"], c["strategy"]): c for c in r["cells"]}
    crash = cell[("crash", 4, "trainmover")]
    assert crash["downtime_s"] == {"median": 0.25, "min": 0.2, "max": 0.3}
    assert crash["downtime_steps"]["median"] == pytest.approx(2.5)
    assert not crash["spread_exceeds_value"] and not crash["within_noise"]
    naive = cell[("planned", 4, "naive")]
    assert naive["spread_exceeds_value"] and naive["failed"] == 1 and naive["runs"] == 4
    planned = cell[("planned", 4, "trainmover")]
    assert planned["within_noise"]
    # inside the noise: the limit is reported, but nothing is divided by it
    assert planned["limit_s"] == 0.01 and "downtime_over_limit" not in planned
    assert cell[("planned", 16, "trainmover")]["downtime_over_limit"]["median"] == \
        pytest.approx(25.0)
    ratios = {(x["scenario"], x["workers"], x["strategy"]): x for x in r["ratios"]}
    x = ratios[("crash", 4, "trainmover")]
    assert x["median"] == pytest.approx(60.0)
    assert x["min"] == pytest.approx(14.0 / 0.3) and x["max"] == pytest.approx(16.0 / 0.2)
    # within noise: no ratio of medians, only restart over the noise (21 / 0.05)
    y = ratios[("planned", 4, "trainmover")]
    assert "median" not in y and y["at_least"] == pytest.approx(420.0)
    (g,) = [g for g in r["growth"] if g["scenario"] == "crash" and g["strategy"] == "trainmover"]
    assert g["seconds"] == pytest.approx(2.0)                 # 0.5 / 0.25
    assert g["steps"] == pytest.approx((0.5 / 0.2) / 2.5)     # in normal steps: no growth
    (g,) = [g for g in r["growth"] if g["scenario"] == "planned" and g["strategy"] == "restart"]
    assert g["seconds"] == pytest.approx(2.0) and g["within_noise"] == []
    (g,) = [g for g in r["growth"] if g["scenario"] == "planned" and g["strategy"] ==
            "trainmover" and g["to"] == 8]
    assert "seconds" not in g and "steps" not in g and g["within_noise"] == [4, 8]
    table = downtime_table(r)
    assert "planned trainmover, 4 -> 8 workers: no ratio: within step noise at 4 and 8 " \
        "workers" in table
    # a cell inside the noise is worded as everywhere (core/accounting.py), not a figure
    assert "| planned | 4 | yes | trainmover | no measurable stall (within step noise, " \
        "±50.0 ms) | - | 0.050 (0.050-0.050) |" in table
    assert "| -0.010" not in table and "| 0.010 (-0.010" not in table
    assert "spread exceeds the value" in table and "1 of 4 runs failed" in table
    assert "inf" not in table
    assert "| no ratio (limit 10.0 ms) |" in table and "| 25.0 (20.0-30.0) |" in table


def test_phase_one_cost_is_the_steps_beyond_normal_before_the_switch():
    from trainmover.core.accounting import phase_one_extra

    # phase 1 from step 6: steps 6..9 take 0.15 s instead of 0.1 s (0.2 s in all)
    gaps = [0.1] * 5 + [0.15] * 4 + [0.3, 0.1, 0.1]
    ends = ends_from_gaps(0.0, gaps)
    assert phase_one_extra(0, 6, 10, ends, 0.1) == pytest.approx(0.2)
    assert phase_one_extra(7, 6, 10, ends[7:], 0.1) is None   # its start is not known
