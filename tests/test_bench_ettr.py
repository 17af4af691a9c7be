"""bench ettr's arithmetic: the useful-time ratio and the table, on hand-made commit times."""
from __future__ import annotations

import pytest

from trainmover.bench import ettr


def commits(gaps: list[float], first_step: int = 0) -> list[dict]:
    t, out = 100.0, []
    for k in range(ettr.SKIP - 1 + len(gaps) + 1):
        out.append({"step": first_step + k, "time": t})
        t += gaps[k - (ettr.SKIP - 1)] if k >= ettr.SKIP - 1 and k - (ettr.SKIP - 1) < len(gaps) \
            else 0.5
    return out


def test_efficiency_counts_a_stall_as_lost_and_ignores_warm_up():
    # 19 normal steps of 0.1 s and one stall of 1.1 s after the warm-up steps; the warm-up
    # gaps (0.5 s) lie before step SKIP - 1 and must not count
    gaps = [0.1] * 10 + [1.1] + [0.1] * 9
    eff, normal = ettr._efficiency(commits(gaps))
    assert normal == pytest.approx(0.1)
    assert eff == pytest.approx(20 * 0.1 / 3.0)


def test_efficiency_is_the_same_at_another_pace():
    # the same run on a machine 1.5x slower: the ratio to its own clean run does not move
    slow = [g * 1.5 for g in [0.1] * 10 + [1.1] + [0.1] * 9]
    assert ettr._efficiency(commits(slow))[0] == pytest.approx(2.0 / 3.0)


def test_table_names_both_ratios_and_normal_steps():
    run = {"steps": 100, "clean_s": 10.0, "trainmover_s": 10.5, "events": 2, "done": 2,
           "lost_s": 0.5, "stall_s": 0.1, "phase1_s": 0.05, "restart_downtime_s": 4.0,
           "clean_step_s": 0.1, "trainmover_step_s": 0.101,
           "ettr": {"trainmover": 0.99, "restart": 10 / 18}, "ettr_same_steps": 10 / 10.5}
    result = {"commit": "abc", "recipe": "demo", "layout": "DP2 x PP2 x TP1", "minutes": 1.0,
              "every_s": 20.0, "standbys": 2, "replenish": False, "repeats": 1,
              "results": [{"strategy": "trainmover", "ettr": 0.99, "ettr_min": 0.99,
                           "ettr_max": 0.99, "events": 2}],
              "runs": [run]}
    table = ettr._table(result)
    assert "same-steps ratio 0.9524" in table
    assert "normal step 100.0 / 101.0 ms" in table
    assert "| trainmover | 0.9900 (0.9900-0.9900) | 2 |" in table


def test_too_few_prestarted_standbys_are_refused_before_any_run():
    with pytest.raises(ValueError, match="--standbys 3 with --no-replenish"):
        ettr.bench_ettr(minutes=10, every=60, standbys=3, replenish=False)
