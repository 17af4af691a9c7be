"""``trainmover bench control``'s small case: a job of 256 simulated workers (32 hosts)
on the real store, agents, worker control code and controller trains, loses a worker,
is recovered from a data-parallel replica onto a standby, trains on, and migrates a worker
onto the other standby; the figures the benchmark reports come out of it."""
import pytest

from trainmover.bench.control import layout_for, parse_sizes, run_once


@pytest.mark.timeout(240)
# groups: the hosts vote in vote groups of four (agent/groupvote.py; the job's 32 hosts vote
# flat by default): the crashed worker's host is a member of host 3's group
@pytest.mark.parametrize("overrides", [[], [("agent.vote_group_hosts", "4")]],
                         ids=["flat", "groups"])
def test_a_simulated_job_of_256_workers_trains_recovers_and_is_measured(tmp_path, overrides):
    # its hosts shared between two simulator processes (the larger sizes need it)
    row = run_once(256, compute_s=0.1, warmup=3, steady=6, after=3, standbys=2,
                   timeout_s=180, work_dir=str(tmp_path), full_hosts=4, sim_procs=2,
                   overrides=overrides)
    assert row["workers"] == 256 and row["hosts"] == 32 and row["sim_procs"] == 2
    assert row["layout"] == {"dp": 4, "pp": 8, "tp": 8}
    # hosts 0-3, the reporter's (7) and the crashed worker's (2): every one of their
    # workers' steady steps was recorded, 8 x 5 x (steady - 1), by both processes; the
    # light ones' are not
    assert row["full_hosts"] == 5 and row["samples"] == 8 * 5 * 5
    assert 0 < row["vote_p50_ms"] <= row["vote_p99_ms"]
    assert row["root_store_rps"] > 256 * 4 * 0.5     # the beats alone: 4 a second each
    assert row["controller_round_ms"] > 0
    assert 0 < row["controller_round_cpu_ms"] <= row["controller_round_cpu_p99_ms"]
    # the crash was detected, planned and recovered from, then steps were committed again
    assert 0 < row["crash_to_plan_s"] < row["recovery_downtime_s"] < 60
    # the planned migration completed (run_once raises otherwise) and was accounted from
    # its stayers' step ends: the other members of the leaver's data-parallel, tensor-
    # and pipeline-parallel groups (its point-to-point neighbours are in the last)
    assert row["migration_stayers"] == 3 + 7 + 7
    assert row["migration_control_s"] is not None and row["migration_control_s"] < 60
    assert 0 < row["migration_to_go_s"] < row["migration_total_s"] < 120
    # the whole hosts' report relays, traced in the simulators' logs: each survivor of the
    # crashed worker's host was heard, and the host's reports written (last) after
    logs = "".join(p.read_text() for p in tmp_path.glob("control-256-*/logs/sim*.log"))
    heard = [f"agent2 heard w{w}'s report of epoch 0" for w in range(16, 24) if w != 17]
    assert all(line in logs for line in heard), logs
    assert logs.rindex("agent2 wrote agent/2/reports/0") > max(logs.index(h) for h in heard)
    assert "agent2 heard w17's" not in logs
    events = "".join(p.read_text() for p in tmp_path.glob("control-256-*/events.jsonl"))
    assert events.count('"vote_group_serving"') == (8 if overrides else 0)
    assert '"vote_group_left"' not in events


def test_sizes_are_checked_before_anything_starts():
    assert parse_sizes("256,1024") == [256, 1024]
    assert layout_for(64).dp == 2 and layout_for(16384).pp == 8
    for bad in ("12", "256,x", "", "8"):
        with pytest.raises(ValueError):
            parse_sizes(bad)


def test_the_simulated_jobs_settings_take_overrides_named_before_anything_starts(
        tmp_path, capsys):
    from trainmover.bench.control import sim_config
    from trainmover.cli import main

    cfg = sim_config(256, 2, [("health.silence_floor_s", "3.5")])
    assert cfg.health.silence_floor_s == 3.5 and cfg.checkpoint.every == 0
    assert main(["bench", "control", "--workers", "256", "--health.silence_floor_s=-1",
                 "--out", str(tmp_path)]) == 2
    assert "health.silence_floor_s" in capsys.readouterr().err
    assert main(["bench", "control", "--workers", "256", "--nosuch.field=1",
                 "--out", str(tmp_path)]) == 2
    assert "nosuch" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_job_past_this_machines_descriptor_limit_is_refused_before_anything_starts(
        tmp_path, capsys, monkeypatch):
    # 8K workers in two simulator processes with the hosts' doors: ~22K descriptors each,
    # over the 20K a process this machine allows (it ran on, every step waiting on hosts
    # that never connected, and failed minutes later as a recovery with no replica)
    from trainmover.bench import control
    from trainmover.cli import main

    monkeypatch.setattr(control, "raise_open_files", lambda at_least=0: 20000)
    assert main(["bench", "control", "--workers", "8192", "--sim-procs", "2",
                 "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--sim-procs 2" in err and "use --sim-procs 3 or more" in err
    # without the doors the store holds the connections: 16K workers are past it
    assert main(["bench", "control", "--workers", "16384", "--sim-procs", "8",
                 "--comm.store_proxy=false", "--out", str(tmp_path)]) == 2
    assert "--comm.store_proxy=false" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    cfg = control.sim_config(8192, 2, [])
    control.check_descriptors(8192, cfg, 3, 20000)      # enough processes
    control.check_descriptors(8192, control.sim_config(8192, 2, [("comm.store_proxy",
                                                                  "false")]), 2, 20000)


@pytest.mark.timeout(200)
def test_a_simulator_out_of_descriptors_ends_the_run_at_once_saying_so(tmp_path):
    # the check above is an estimate: past it at run time, the simulator process ends and
    # the run fails with its reason, instead of running on with hosts that never connected
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(f"""
        import resource, time
        resource.setrlimit(resource.RLIMIT_NOFILE, (500, 500))   # ~700 needed a process
        from trainmover.bench.control import run_once
        t = time.monotonic()
        try:
            run_once(256, compute_s=0.1, warmup=3, steady=6, after=3, standbys=2,
                     timeout_s=150, work_dir={str(tmp_path)!r}, full_hosts=4, sim_procs=2)
        except RuntimeError as exc:
            print("FAILED after", round(time.monotonic() - t), "s:", exc)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=190)
    assert "FAILED after" in out.stdout, out.stdout + out.stderr
    line = out.stdout.split("FAILED after", 1)[1]
    assert "simulator process" in line and "descriptors" in line, line
    assert int(line.split()[0]) < 30      # not the store client's connect timeout (120 s)


def test_a_counters_rate_is_read_over_a_window_with_fewer_than_two_samples_inside():
    # a short steady window on a loaded machine held one store reading (CI saw None)
    from trainmover.bench.control import rate

    samples = [(0.0, 0.0), (1.0, 100.0), (2.0, 300.0)]
    assert rate(samples, 0.5, 1.5) == pytest.approx(150.0)   # 50 at 0.5, 200 at 1.5
    assert rate(samples, 1.2, 1.4) == pytest.approx(200.0)   # no sample inside
    assert rate(samples, 0.0, 2.0) == pytest.approx(150.0)
    assert rate(samples, 1.5, 2.5) is None                    # none after the window
    assert rate(samples, 1.0, 1.0) is None
