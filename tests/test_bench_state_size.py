"""bench state-size: the model sizing (from ModelConfig.num_params, no model built), the rows
and the table from hand-made measurements (no job runs), and one end-to-end run of the
smallest size (slow)."""
from __future__ import annotations

import json
import os

import pytest

from trainmover.bench import state_size as ss
from trainmover.cli import make_parser
from trainmover.core.topology import Layout

CONTEXT = {"command": "trainmover bench state-size --sizes 10", "commit": "abc1234",
           "machine": {"cpu": "test cpu", "cores": 2, "torch": "2.x"}}


@pytest.mark.parametrize("size_mb", [1, 10, 100, 500, 2000, 5000])
def test_a_size_gives_a_model_whose_state_is_within_15_percent(size_mb):
    model = ss.size_model(size_mb)
    model.validate()
    model.validate_layout(Layout(2, 1, 1))
    state = 12 * model.num_params()          # fp32 parameters + AdamW's two moments
    assert ss.state_bytes_of(model) == state
    assert abs(state - size_mb * 1e6) <= 0.15 * size_mb * 1e6
    assert (model.vocab_size, model.seq_len, model.mlp_ratio) == (ss.VOCAB, ss.SEQ_LEN,
                                                                   ss.MLP_RATIO)


def test_sizes_grow_with_the_request_and_a_bad_size_is_refused():
    params = [ss.size_model(s).num_params() for s in ss.SIZES_MB]
    assert params == sorted(params)
    with pytest.raises(ValueError, match="positive"):
        ss.size_model(0)


def test_the_job_is_dp2_eager_small_batch_without_periodic_checkpoints():
    cfg = ss.job_config(ss.size_model(10))
    assert (cfg.layout.dp, cfg.layout.pp, cfg.layout.tp) == (2, 1, 1)
    assert cfg.train.global_batch == 2 and not cfg.train.compile
    assert cfg.checkpoint.every == 0


def test_memory_estimate_and_steps():
    model = ss.size_model(2000)
    assert ss.memory_needed(model) == ss.MEM_BYTES_PER_PARAM * model.num_params() + \
        ss.MEM_OVERHEAD
    # the calibration's warm step (or the event step, if later), with room after it
    assert ss.steps_for(2) == ss.steps_for(ss.EVENT_STEP)
    assert ss.steps_for(60) >= 60 + ss.STEPS_AFTER_EVENT


def test_the_cli_has_the_subcommand_with_its_defaults():
    args = make_parser().parse_args(["bench", "state-size"])
    assert (args.sizes, args.repeats, args.scenarios, args.strategies, args.name, args.out) == \
        ("10,100,500,2000", 3, "planned,crash", "stop_and_copy,precopy", "state_size",
         "benchmarks/results")


def _run(scenario, downtime, strategy="stop_and_copy", state=10_400_000, digest="d0",
         **extra):
    run = {"scenario": scenario, "strategy": strategy, "downtime_s": downtime,
           "downtime_noise_s": 0.01 if scenario == "planned" else None,
           "normal_step_s": 0.1, "weights_sha256": digest, "state_bytes": state,
           "switch_bytes": state, "pre_switch_bytes": 0,
           "peak_rss_mb": {"leaver": 500.0, "joiner": 520.0, "stayers": 510.0}}
    if scenario == "planned":
        run.update(transfer_s=0.05, joiner_recv_s=0.4, phase1_slowdown_s=0.02,
                   phase1={"ratio": 1.2})
    return {**run, **extra}


def _size():
    return ss.size_info(10)


def test_rows_from_fake_measurements():
    runs = [_run("planned", 0.30), _run("planned", 0.50), _run("planned", 0.40),
            _run("crash", 1.0, peak_rss_mb={"leaver": 400.0, "joiner": 700.0,
                                           "stayers": 600.0}),
            _run("crash", 2.0, digest="other"),
            {"scenario": "crash", "strategy": "stop_and_copy", "downtime_s": None,
             "error": "RuntimeError: the job ended"}]
    rows = ss.size_rows(_size(), runs, "d0", {"bytes": 10_400_000, "seconds": 0.02}, CONTEXT)
    planned, crash = rows
    assert [r["scenario"] for r in rows] == ["planned", "crash"]
    for row in rows:
        for key in ("state_bytes", "strategy", "scenario", "downtime_s",
                    "downtime_over_stop_and_copy", "weights_equal", "switch_bytes",
                    "pre_switch_bytes", "p2p_s", "downtime_over_p2p", "transfer_s",
                    "joiner_recv_s", "phase1_step_ratio", "peak_rss_mb", "command", "commit",
                    "machine"):
            assert key in row, key
    assert planned["downtime_s"] == {"median": 0.40, "min": 0.30, "max": 0.50}
    assert planned["downtime_over_stop_and_copy"] == 1.0
    assert planned["weights_equal"] is True and planned["weights_compared"] == "3/3"
    assert planned["state_bytes"] == planned["switch_bytes"] == 10_400_000
    assert planned["pre_switch_bytes"] == 0
    assert planned["downtime_over_p2p"]["median"] == pytest.approx(20.0)
    assert planned["p2p_gb_per_s"] == pytest.approx(0.52)
    assert planned["phase1_step_ratio"]["median"] == pytest.approx(1.2)
    assert planned["transfer_s"]["median"] == pytest.approx(0.05)
    assert crash["runs"] == 3 and crash["failed"] == 1
    assert crash["weights_equal"] is False and crash["weights_compared"] == "1/2"
    assert crash["transfer_s"] is None and crash["phase1_step_ratio"] is None
    assert crash["peak_rss_mb"] == {"leaver": 500.0, "joiner": 700.0, "stayers": 600.0}
    assert crash["commit"] == "abc1234"


def test_a_later_strategy_is_divided_by_stop_and_copy_of_the_same_size_and_scenario():
    runs = [_run("planned", 0.4), _run("planned", 0.1, strategy="precopy"),
            _run("planned", 0.2, strategy="precopy")]
    rows = ss.size_rows(_size(), runs, "d0", None, CONTEXT)
    pre = next(r for r in rows if r["strategy"] == "precopy")
    assert pre["downtime_over_stop_and_copy"]["median"] == pytest.approx(0.15 / 0.4)
    assert pre["downtime_over_p2p"] is None            # no bandwidth measured


def test_the_table_has_a_row_per_cell_and_says_where_the_bench_stopped():
    rows = ss.size_rows(_size(), [_run("planned", 0.4), _run("crash", 1.5)], "d0",
                        {"bytes": 10_400_000, "seconds": 0.02}, CONTEXT)
    big = ss.size_info(2000)
    why = "does not fit: needs about 15.1 GiB, 9.0 GiB available"
    rows += ss.skipped_rows(big, ["planned", "crash"], ["stop_and_copy"], why, CONTEXT)
    result = {"layout": "DP2", "repeats": 1, "rows": rows, "calibrations":
              {"10": {"warm_step": 40, "normal_step_s": 0.05, "steps": 77}},
              "stopped_at": {"size_mb": 2000.0, "why": why}, **CONTEXT}
    table = ss.state_size_table(result)
    body = [line for line in table.splitlines() if line.startswith("| ")]
    assert len(body) == 1 + 4                      # header + 4 cells
    assert all(line.count("|") == body[0].count("|") for line in body)
    assert "| 10.4 | d128 x 4" in table and "| planned | stop_and_copy | 0.400" in table
    assert "not measured: does not fit" in table and "Stopped at 2000 MB" in table
    assert "warm at step 40" in table
    json.dumps(result)                               # the result file is plain JSON


def test_phase_one_steps_and_roles_from_the_logs():
    events = [{"event": "process_started", "name": "w0", "pid": 1, "standby": False},
              {"event": "process_started", "name": "w1", "pid": 2, "standby": False},
              {"event": "process_started", "name": "s0", "pid": 3, "standby": True},
              {"event": "migration_prepare", "part": "stayer", "time": 10.05},
              {"event": "migration_done", "status": "done", "stayers": ["w0"],
               "pairs": [{"leaver": "w1", "joiner": "s0", "role": "dp1.pp0.tp0"}]}]
    # steps 0-9 commit every 1 s (step 0 slow), 10-13 (phase 1) take 0.15 s, switch at 14
    records = [{"step": s, "time": float(s + 1), "step_time_s": 0.5 if s == 0 else 0.1}
               for s in range(10)]
    records += [{"step": s, "time": 10.0 + (s - 9), "step_time_s": 0.15} for s in range(10, 16)]
    got = ss.phase_one_steps(events, records, switch_step=14)
    assert got["prepare_step"] == 10 and got["steps"] == 4
    assert got["ratio"] == pytest.approx(1.5)
    assert ss.roles_of(events, "planned") == {"leaver": ["w1"], "joiner": ["s0"],
                                              "stayers": ["w0"]}
    crash = events[:3] + [{"event": "recovery_done", "status": "done",
                           "pairs": [{"failed": "w1", "joiner": "s0", "role": "r"}]}]
    assert ss.roles_of(crash, "crash") == {"leaver": ["w1"], "joiner": ["s0"],
                                           "stayers": ["w0"]}


def test_peak_rss_reads_the_processes_named_in_the_events(tmp_path):
    with open(tmp_path / "events.jsonl", "w") as f:
        f.write(json.dumps({"event": "process_started", "name": "me", "pid": os.getpid()})
                + "\n")
    rss = ss.PeakRss(str(tmp_path))
    rss.sample()
    assert rss.pids == {"me": os.getpid()} and rss.peak["me"] > 10


@pytest.mark.slow
def test_end_to_end_smallest_size_one_repeat(tmp_path):
    result = ss.bench_state_size([10], repeats=1, out_dir=str(tmp_path), name="ss",
                                 scratch=str(tmp_path / "scratch"))
    assert (tmp_path / "ss.md").is_file() and (tmp_path / "ss.json").is_file()
    rows = {(r["scenario"], r["strategy"]): r for r in result["rows"]}
    assert set(rows) == {("planned", "stop_and_copy"), ("planned", "precopy"),
                         ("crash", "stop_and_copy")}
    for row in rows.values():
        assert row["failed"] == 0, row["errors"]
        assert row["weights_equal"] is True
        assert abs(row["state_bytes"] - 10e6) <= 0.15 * 10e6
        assert row["p2p_s"] > 0 and row["downtime_s"]["median"] is not None
        assert row["peak_rss_mb"]["joiner"] and row["peak_rss_mb"]["stayers"]
    assert rows["planned", "stop_and_copy"]["transfer_s"]["median"] > 0
    # the pre-copy moved the parameters and moments before the switch, the rest at it
    pre = rows["planned", "precopy"]
    assert pre["pre_switch_bytes"] > 0.9 * pre["state_bytes"]
    assert pre["switch_bytes"] < 0.1 * pre["state_bytes"]
