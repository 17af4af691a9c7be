"""Planned live migration end to end: real processes, compared with uninterrupted runs."""
import json
import os
import random
import subprocess
import sys
import time

import pytest

from trainmover.api import Job
from trainmover.control.coordinator import run_job
from trainmover.core.events import read_jsonl
from trainmover.core.faults import Inject, WorkerFault
from trainmover.recipes import get_recipe
from trainmover.core.topology import Layout

from test_failures import with_faults
from test_warmup import check_joiners_warmed

SEED = int(os.environ.get("TRAINMOVER_TEST_SEED", "7"))


def job(dp, pp, tp, steps, standbys, **settings):
    """``settings``: ``JobConfig.override`` names (``faults=[...]``)."""
    cfg = get_recipe("tiny")
    cfg.layout = Layout(dp, pp, tp)
    cfg.train.steps = steps
    cfg.train.threads_per_worker = 1  # equal in both runs, whatever the process count
    return cfg.override(standby_count=standbys, **settings).validate()


def events_of(run_dir, name):
    return [e for e in read_jsonl(os.path.join(run_dir, "events.jsonl")) if e["event"] == name]


@pytest.mark.timeout(600)
def test_migrations_of_every_stage_kind_are_bit_identical(tmp_path):
    """DP2xPP3xTP2 (12 workers, 3 standbys): migrate a first-stage role, a middle-stage role
    on TP rank 1 and a last-stage role on TP rank 1, one after another, at random steps."""
    rng = random.Random(SEED)
    cfg = job(2, 3, 2, 40, 3)
    layout = cfg.layout
    names = {layout.role_of(i).name: f"w{i}" for i in range(layout.num_roles)}
    targets = [names["dp0.pp0.tp0"], names["dp1.pp1.tp1"], names["dp0.pp2.tp1"]]
    steps = sorted(rng.sample(range(2, 12), 3))
    injects = [Inject("migrate", s, t) for s, t in zip(steps, targets)]
    base = run_job(cfg, str(tmp_path / "base"), quiet=True, timeout_s=300)
    moved = run_job(cfg, str(tmp_path / "moved"), quiet=True, timeout_s=400, injects=injects)
    done = [m for m in moved["migrations"] if m["status"] == "done"]
    assert [m["pairs"][0]["leaver"] for m in done] == targets, (SEED, steps, moved["migrations"])
    assert moved["weights_sha256"] == base["weights_sha256"], (SEED, steps)
    assert moved["steps"] == base["steps"] == 40
    # only the leaver's groups were rebuilt, and only their members took part
    run_dir = str(tmp_path / "moved")
    prepared = events_of(run_dir, "migration_prepare")
    for m in done:
        role = layout.role_of(int(m["pairs"][0]["leaver"][1:]))
        affected = layout.affected_groups(role)
        assert m["groups_rebuilt"] == len(affected) and set(m["affected_groups"]) == set(affected)
        assert m["groups_total"] == len(layout.communicator_groups())
        mine = [e for e in prepared if e["migration_id"] == m["migration_id"]]
        built = {g for e in mine for g in e["groups"]}
        assert built == set(affected)
        members = {r.name for spec in affected.values() for r in spec.members}
        assert {e["role"] for e in mine} <= members
        # a real bound, far from what a restart of these 12 processes costs (importing torch
        # alone takes seconds each) yet generous for a loaded 2-core machine
        assert m["downtime_s"] is not None and m["downtime_s"] < 3.0, m
    assert set(moved["membership"]) == {f"w{i}" for i in range(12)} - set(targets) | {"s0", "s1", "s2"}
    # each joiner had warmed up into every stage structure before it said it was ready (the
    # promotion of a warmed standby into each stage kind: test_warmup's slow-suite twin)
    check_joiners_warmed(run_dir, done, {"first-2", "middle-1", "last-1"})


@pytest.mark.slow   # in `make test-slow`: a sibling in the default suite covers its mechanism
@pytest.mark.timeout(400)
def test_two_workers_at_once(tmp_path):
    # long enough for both standbys to finish the shadow run they are in when assigned
    cfg = job(2, 2, 1, 60, 2)
    base = run_job(cfg, str(tmp_path / "base"), quiet=True, timeout_s=200)
    moved = run_job(cfg, str(tmp_path / "moved"), quiet=True, timeout_s=200,
                    injects=[Inject("migrate", 4, "w0"), Inject("migrate", 4, "w3")])
    (m,) = moved["migrations"]
    assert m["status"] == "done" and len(m["pairs"]) == 2
    assert {p["leaver"] for p in m["pairs"]} == {"w0", "w3"}
    assert moved["weights_sha256"] == base["weights_sha256"]


@pytest.mark.timeout(400)
def test_joiner_dying_in_phase_1_aborts_cleanly_and_a_retry_succeeds(tmp_path):
    cfg = job(2, 2, 1, 30, 2, faults=[WorkerFault("s0", "joiner_prepare").__dict__])
    base = run_job(job(2, 2, 1, 30, 2), str(tmp_path / "base"), quiet=True, timeout_s=200)
    running = Job(cfg, str(tmp_path / "moved"), timeout_s=300).start()
    first = running.migrate(["w1"], ["s0"], timeout_s=120)
    assert first["status"] == "aborted" and "s0 died in phase 1" in first["reason"]
    second = running.migrate(["w1"], timeout_s=120)
    assert second["status"] == "done" and second["pairs"][0]["joiner"] == "s1"
    summary = running.wait(300)
    assert summary["weights_sha256"] == base["weights_sha256"]
    assert summary["steps"] == 30
    assert [m["status"] for m in summary["migrations"]] == ["aborted", "done"]


@pytest.mark.timeout(300)
def test_a_migration_accounted_at_the_end_is_read_before_the_store_goes_down(
        tmp_path, monkeypatch):
    # A migration in a job's last steps is accounted at the job's end, from the stayers'
    # step ends in the store: that read once came after the processes (and the store)
    # stopped, failing the finished job with "Failed to recv". Every migration is accounted
    # at the end here (the controller runs in this process), so the switch step's timing
    # does not matter.
    from trainmover.control.migrations import Migrations

    original = Migrations.finish_downtimes
    monkeypatch.setattr(Migrations, "finish_downtimes",
                        lambda self, final=False: original(self, final) if final else None)
    moved = run_job(job(2, 1, 1, 60, 1), str(tmp_path / "moved"), quiet=True, timeout_s=250,
                    injects=[Inject("migrate", 4, "w1")])
    (m,) = moved["migrations"]
    assert m["status"] == "done" and moved["steps"] == 60, m
    # the stayer's step ends were read, if it posted them: it does once the two steps after
    # the switch have ended (a standby slow to warm on a loaded machine may switch later)
    from trainmover.core import protocol as P

    if m["switch_step"] + P.DOWNTIME_STEPS_AFTER < 59:
        assert m["downtime_by"]["reported"] == 1, m


def cli(*args):
    return subprocess.run([sys.executable, "-m", "trainmover", *args], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.slow   # in `make test-slow`: a sibling in the default suite covers its mechanism
@pytest.mark.timeout(400)
def test_migrate_command_against_a_running_job(tmp_path):
    # the job must outlive six `trainmover migrate` processes (each imports torch for its
    # store client: seconds on a loaded 2-core machine), hence its many (fast) steps
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainmover", "run", "--recipe", "tiny", "--dp", "2", "--pp", "2",
         "--steps", "1500", "--standbys", "1", "--run-dir", str(run_dir), "--quiet"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (run_dir / "metrics.jsonl").exists():
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.2)
        refused = [
            (["--worker", "w9"], "unknown worker 'w9'"),
            (["--worker", "s0"], "worker s0 is a standby"),
            (["--worker", "w1", "--worker", "w1"], "worker w1 is named twice"),
        ]
        for args, message in refused:
            res = cli("migrate", "--run-dir", str(run_dir), *args)
            out = json.loads(res.stdout)
            assert res.returncode == 1 and out["status"] == "refused", res.stdout
            assert message in out["reason"]
        res = cli("migrate", "--run-dir", str(run_dir), "--worker", "w2", "--to", "s0")
        out = json.loads(res.stdout)
        assert res.returncode == 0 and out["status"] == "done", res.stdout + res.stderr
        assert out["pairs"] == [{"leaver": "w2", "joiner": "s0", "role": "dp1.pp0.tp0"}]
        res = cli("migrate", "--run-dir", str(run_dir), "--worker", "w3")
        out = json.loads(res.stdout)
        assert out["status"] == "refused" and "no free standby" in out["reason"]
        res = cli("migrate", "--run-dir", str(run_dir), "--worker", "w2")
        assert "already left" in json.loads(res.stdout)["reason"]
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["membership"]["s0"] == "dp1.pp0.tp0"
        assert [m["status"] for m in summary["migrations"]] == ["done"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_migrate_command_without_a_job(tmp_path):
    res = cli("migrate", "--run-dir", str(tmp_path), "--worker", "w1")
    assert res.returncode == 2 and "not the run dir of a running job" in res.stderr


@pytest.mark.timeout(400)
def test_the_naive_baseline_migration_starts_its_joiner_at_the_switch_and_stays_exact(tmp_path):
    """The baseline the benchmarks compare with (``naive``: no preparation, the joiner a
    fresh process started once its leaver reached the switch, by its signed at_switch
    record) still moves the role with the uninterrupted run's weights."""
    cfg = job(2, 1, 1, 40, 0)
    base = run_job(cfg, str(tmp_path / "base"), quiet=True, timeout_s=200)
    running = Job(cfg, str(tmp_path / "moved"), timeout_s=300).start()
    result = running.coordinator.request_migration(["w1"], naive=True,
                                                   source="test").result(timeout=200)
    assert result["status"] == "done", result
    summary = running.wait(300)
    assert summary["weights_sha256"] == base["weights_sha256"]
    (started,) = events_of(str(tmp_path / "moved"), "migration_started")
    assert started["naive"] is True


def precopy_job(steps, standbys, **settings):
    """DP2xPP3 with pre-copy, one parameter per step boundary (a chunk of one byte holds
    one): the background phase spans as many steps as a stage has parameters (15-18)."""
    return job(2, 3, 1, steps, standbys, migration_precopy=True,
               migration_precopy_chunk_mb=1e-6, **settings)


@pytest.mark.timeout(600)
def test_precopied_migrations_of_a_first_middle_and_last_role_are_bit_identical(
        tmp_path, reference_weights):
    cfg = precopy_job(60, 3)   # the first stage has 32 parameters: 32 steps of pre-copy
    layout = cfg.layout
    names = {layout.role_of(i).name: f"w{i}" for i in range(layout.num_roles)}
    targets = [names["dp0.pp0.tp0"], names["dp1.pp1.tp0"], names["dp0.pp2.tp0"]]
    # one migration of three pairs: three pre-copies at once
    moved = run_job(cfg, str(tmp_path / "moved"), quiet=True, timeout_s=400,
                    injects=[Inject("migrate", 3, t) for t in targets])
    (m,) = moved["migrations"]
    assert m["status"] == "done" and sorted(p["leaver"] for p in m["pairs"]) == sorted(targets)
    assert moved["weights_sha256"] == reference_weights(cfg)
    run_dir = str(tmp_path / "moved")
    assert events_of(run_dir, "precopy_abandoned") == []
    # each joiner checked its replayed copy against its leaver's checksums
    assert sorted(e["worker"] for e in events_of(run_dir, "precopy_verified")) == \
        sorted(p["joiner"] for p in m["pairs"])
    assert events_of(run_dir, "precopy_unverified") == []
    sent = {e["worker"]: e for e in events_of(run_dir, "precopy_sent")}
    assert sorted(sent) == sorted(targets)
    for e in events_of(run_dir, "migration_switched"):
        if e["part"] == "leaver":
            # the joiner replayed steps after the copy, and the switch moved no parameter or
            # moment: what is left (buffers, generators) is a small part of the state
            assert e["precopy_steps"] > 0 and e["transfer_bytes"] < sent[e["worker"]]["bytes"] / 10


@pytest.mark.timeout(600)
@pytest.mark.parametrize("fault", ["stayer", "leaver", "joiner"])
def test_a_failure_during_the_precopy_loses_nothing(tmp_path, reference_weights, fault):
    """A crash while the state is pre-copied (the leaver, a stayer, or the joiner while it
    replays the leaver's steps): the migration is given up or the role recovered, and the
    job ends on the uninterrupted run's weights."""
    # phase 1 takes ~5 steps here, then the 15 parameters of w1's stage go one per step:
    # a crash at step 14 is well inside the pre-copy (checked below)
    crash = {"stayer": Inject("crash", 14, "w3"), "leaver": Inject("crash", 14, "w1"),
             "joiner": Inject("crash", 12, "joiner", "joiner_precopy")}[fault]
    cfg = with_faults(precopy_job(34, 2), crash)
    moved = run_job(cfg, str(tmp_path / "moved"), quiet=True, timeout_s=400,
                    injects=[Inject("migrate", 3, "w1")])
    assert moved["weights_sha256"] == reference_weights(precopy_job(34, 2)), moved["migrations"]
    run_dir = str(tmp_path / "moved")
    (fired,) = events_of(run_dir, "fault_injected")
    started = events_of(run_dir, "precopy_started")
    assert started and started[0]["time"] < fired["time"]
    # the crash came before the switch: the pre-copy was still going on
    switched = events_of(run_dir, "migration_switched")
    assert all(e["time"] > fired["time"] for e in switched)
