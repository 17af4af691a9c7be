"""The straggler detector on synthetic step times: a slow worker is found within the
documented number of windows; no false positive when everyone slows together, when a stage
is heavier by design, under per-step noise, or in a joiner's first steps."""
import random
from statistics import median

from hypothesis import given, settings, strategies as st

from trainmover.core.stragglers import (DetectorSettings, StragglerDetector, Window,
                                        worth_moving)
from trainmover.core.topology import Layout

S = DetectorSettings()   # the defaults


def roles(dp, pp):
    return {f"w{i}": r for i, r in enumerate(Layout(dp, pp, 1).roles())}


def run(layout_roles, compute, windows, noise=0.0, seed=0, tenure=None, read_every=1):
    """Feed ``windows`` windows; ``compute(worker, role, step)`` is a step's compute time,
    times a uniform ±``noise`` factor. ``read_every``: the windows come in batches of that
    many (a controller that reads less often than a window passes: the workers' messages
    carry their recent windows). Returns the verdicts, in order."""
    rng = random.Random(seed)
    det = StragglerDetector(S)
    out = []
    pending = []
    for k in range(windows):
        first, last = k * S.window, k * S.window + S.window - 1
        for w, r in layout_roles.items():
            times = [compute(w, r, s) * (1 + rng.uniform(-noise, noise))
                     for s in range(first, last + 1)]
            start = (tenure or {}).get(w, 0)
            if last < start:
                continue
            pending.append(Window(w, r, first, last, start, median(times)))
        if (k + 1) % read_every == 0 or k == windows - 1:
            out += det.observe(pending)
            pending = []
    return out


def stragglers(verdicts):
    return sorted({v.worker for v in verdicts if v.straggler})


def test_a_slow_worker_is_detected_within_min_windows_of_the_onset():
    onset = 40   # step: the first of a window
    v = run(roles(2, 2), lambda w, r, s: 0.10 * (1.3 if w == "w1" and s >= onset else 1.0),
            20)
    flagged = [x for x in v if x.straggler]
    assert {x.worker for x in flagged} == {"w1"}
    first = flagged[0]
    # the onset's window is the first slow one; once most of the last min_windows are slow
    # (their median is), it is a straggler
    assert first.step == onset + (S.min_windows // 2 + 1) * S.window - 1
    assert first.reference == "peers" and abs(first.score - 1 / 1.3) < 0.01
    assert abs(first.excess_s - 0.03) < 1e-6


def test_windows_read_in_batches_give_the_same_verdicts():
    """A controller that reads the measurements every third window judges every window,
    each against its peers' windows of the same steps, as one reading each window."""
    def compute(w, r, s):
        return 0.10 * (1.3 if w == "w1" and s >= 40 else 1.0)

    def key(verdicts):
        return sorted((v.worker, v.step, v.score, v.straggler) for v in verdicts)

    one, batched = run(roles(2, 2), compute, 20, noise=0.1, seed=3), \
        run(roles(2, 2), compute, 20, noise=0.1, seed=3, read_every=3)
    assert key(batched) == key(one)
    assert [v.step for v in batched if v.straggler][0] == 40 + 3 * S.window - 1


def test_everyone_slowed_together_is_no_straggler():
    v = run(roles(2, 2), lambda w, r, s: 0.10 * (1.5 if s >= 40 else 1.0), 20)
    assert stragglers(v) == [] and all(x.reference == "peers" for x in v)


def test_a_last_stage_heavier_by_design_is_no_straggler():
    v = run(roles(2, 4), lambda w, r, s: 0.10 * (1.6 if r.pp == 3 else 1.0), 20)
    assert stragglers(v) == []


def test_per_step_noise_gives_no_false_positive_in_20_runs():
    for seed in range(20):
        v = run(roles(4, 2), lambda w, r, s: 0.10, 40, noise=0.20, seed=seed)
        assert stragglers(v) == [], seed


def test_a_joiners_first_steps_are_not_judged():
    # s0 took w1's role at step 50: its first windows are slow (compilation, cold caches)
    layout = roles(2, 2)
    layout["s0"] = layout.pop("w1")
    v = run(layout, lambda w, r, s: 0.10 * (3.0 if w == "s0" and s < 64 else 1.0), 30,
            tenure={"s0": 48})
    assert stragglers(v) == []


def test_without_peers_a_change_from_the_own_baseline_is_detected():
    v = run(roles(1, 2), lambda w, r, s: (0.2 if r.pp == 1 else 0.1) *
            (1.25 if w == "w0" and s >= 80 else 1.0), 30)
    assert stragglers(v) == ["w0"]
    assert {x.reference for x in v} == {"baseline"}


@settings(max_examples=40, deadline=None)
@given(factor=st.floats(0.3, 3.0), onset=st.integers(0, 100), seed=st.integers(0, 1000))
def test_a_common_slowdown_never_flags_anyone(factor, onset, seed):
    v = run(roles(2, 3), lambda w, r, s: (0.1 + 0.02 * r.pp) * (factor if s >= onset else 1),
            30, noise=0.05, seed=seed)
    assert stragglers(v) == []


def test_cost_rule():
    assert worth_moving(0.03, 1000, 1.0)          # 30 s lost vs a 1 s move
    assert not worth_moving(0.03, 20, 1.0)        # 0.6 s left to lose
    assert not worth_moving(0.03, -5, 1.0)


# --- in a running job ----------------------------------------------------------------------


import pytest  # noqa: E402

from trainmover.control.coordinator import run_job  # noqa: E402
from trainmover.core.events import read_jsonl  # noqa: E402
from trainmover.core.faults import Inject  # noqa: E402

from test_failures import job, with_faults  # noqa: E402

STEPS = 160


def straggler_job(policy, *injects):
    # a migration of this tiny job costs well under 0.1 s; the default assumed cost (1 s,
    # until one is measured) would make the rule keep a 1.3x worker for the few steps left
    cfg = job(steps=STEPS, standbys=1, straggler_policy=policy,
              straggler_migration_cost_s=0.05)
    return with_faults(cfg, *injects)


def events_of(tmp_path, name):
    return [e for e in read_jsonl(str(tmp_path / "run" / "events.jsonl")) if e["event"] == name]


@pytest.fixture(scope="module")
def straggler_baseline(reference_weights):
    return reference_weights(straggler_job("off"))


@pytest.mark.timeout(300)
# the detection is the same under both policies; "alert" (detected, not moved) is slow-suite
@pytest.mark.parametrize("policy", [pytest.param("alert", marks=pytest.mark.slow), "migrate"])
def test_a_slow_worker_is_detected_and_moved_only_under_migrate(tmp_path, straggler_baseline,
                                                                policy):
    """The detector's sensitivity (1.2-1.3x found, no healthy worker flagged under +-20%
    noise) is measured on synthetic times above and by `trainmover bench stragglers`; here the
    pipeline around it runs in a real job. Its steps compute for 11-17 ms, and on a loaded
    2-core machine two healthy peers' CPU times drift apart for several windows (the two
    vCPUs can be one core's hyperthreads, whose CPU time stretches when the sibling is busy;
    measured in CI runs: a joiner against an old stayer, 1.185x, and a stayer against the
    straggler's replacement, 1.27x), which the default 0.15 shift cannot tell from a
    straggler. So this job uses a 0.4 shift and a 2x straggler: a margin of 0.4 and more
    either way."""
    onset, factor = 40, 2.0
    cfg = straggler_job(policy, Inject("slow", onset, "w1", str(factor)))
    cfg.straggler.min_shift = 0.4
    summary = run_job(cfg, str(tmp_path / "run"), quiet=True, timeout_s=300)
    found = summary["stragglers"]
    assert [f["worker"] for f in found] == ["w1"], found
    s = cfg.straggler
    # the documented latency is min_windows // 2 + 1 windows after the onset (one more if
    # the onset falls inside a window); every window counts, however seldom the controller
    # reads them
    assert onset < found[0]["step"] <= onset + (s.min_windows // 2 + 2) * s.window, found
    # the score at detection is the median over the rule's windows, at most
    # 1 / (1 + min_shift) by the rule itself (not asserted: it cannot fail); the injected
    # slowdown puts it near 1 / factor, but a run whose slow windows read low is detected
    # the moment their median crosses the threshold, just under it. What can go wrong is
    # overstating the slowdown: the score must not read as much worse than the factor
    assert found[0]["reference"] == "peers"
    assert found[0]["score"] > 1 / (factor + 0.2), found
    moves = [m for m in summary["migrations"] if m["status"] == "done"]
    if policy == "alert":
        assert moves == [] and events_of(tmp_path, "straggler_migration") == []
    else:
        assert [p["leaver"] for m in moves for p in m["pairs"]] == ["w1"]
        assert "w1" not in summary["membership"]
    assert summary["weights_sha256"] == straggler_baseline


@pytest.mark.timeout(300)
# slow suite: the detector's verdicts on a common slowdown are the unit tests' above
# (test_everyone_slowed_together_is_no_straggler, test_a_common_slowdown_never_flags_anyone),
# and the job above checks that none but the slow worker is flagged in a real job
@pytest.mark.slow
@pytest.mark.parametrize("case", ["everyone", "last-stage"])
def test_no_false_positive_for_a_slowdown_by_design(tmp_path, case):
    """Everyone slowed together (longer sequences for all); or the last pipeline stage's
    workers (w1 and w3 hold dp0.pp1 and dp1.pp1) heavier than the first from the start."""
    slowed = ["w0", "w1", "w2", "w3"] if case == "everyone" else ["w1", "w3"]
    onset = 40 if case == "everyone" else 1
    cfg = straggler_job("migrate", *[Inject("slow", onset, w, "1.5") for w in slowed])
    summary = run_job(cfg, str(tmp_path / "run"), quiet=True, timeout_s=300)
    assert summary["stragglers"] == [] and summary["migrations"] == []


# --- maintenance ---------------------------------------------------------------------------

from trainmover.api import Job  # noqa: E402
from trainmover.control.maintenance import drain  # noqa: E402
from trainmover.control.status import read_status  # noqa: E402

from mp_harness import wait_for  # noqa: E402


def _warm(run_dir, n):
    try:
        return len(read_status(run_dir).free_standbys("warm")) >= n
    except ValueError:   # no controller snapshot yet
        return False


@pytest.mark.timeout(300)
def test_drain_moves_two_workers_at_once(tmp_path, straggler_baseline):
    run_dir = str(tmp_path / "run")
    cfg = job(steps=STEPS, standbys=2, straggler_policy="off",
              straggler_migration_cost_s=0.05)
    running = Job(cfg, run_dir, timeout_s=280).start()
    wait_for(lambda: _warm(run_dir, 2), 120, "two warm standbys")
    with pytest.raises(ValueError, match=r"\['w9'\] hold no role"):
        drain(run_dir, ["w0", "w9"], say=lambda line: None)
    result = drain(run_dir, ["w0", "w3"], say=lambda line: None)
    assert result["status"] == "done" and result["moved"] == ["w0", "w3"]
    assert len(result["batches"]) == 1          # both in one migration, in parallel
    summary = running.wait(280)
    (mig,) = summary["migrations"]
    assert sorted(p["leaver"] for p in mig["pairs"]) == ["w0", "w3"]
    assert not {"w0", "w3"} & set(summary["membership"])
    assert summary["weights_sha256"] == straggler_baseline


@pytest.mark.timeout(300)
def test_rolling_rebalance_moves_workers_in_turn(tmp_path, straggler_baseline):
    cfg = job(steps=STEPS, standbys=1, straggler_policy="off",
              maintenance_rebalance_every_s=2.0, standby_replenish=True)
    summary = run_job(cfg, str(tmp_path / "run"), quiet=True, timeout_s=300)
    done = [m for m in summary["migrations"] if m["status"] == "done"]
    leavers = [m["pairs"][0]["leaver"] for m in done]
    assert len(done) >= 2 and leavers[:2] == ["w0", "w1"], leavers   # roles in turn
    assert summary["weights_sha256"] == straggler_baseline


def test_the_meter_publishes_gpu_clock_and_temperature_where_torch_reads_them(monkeypatch):
    """On a GPU each window carries its SM clock and temperature; where they cannot be read
    (no NVML binding) they are left out and not asked for again. CPU here: the reading is
    faked, the rest of the meter is real."""
    from trainmover.core import protocol as P
    from trainmover.worker import perf

    class Groups:
        def slots(self):
            return {}

    def run(meter, sent):
        for step in range(4):
            meter.begin(step, Groups())
            meter.end(step, 0.01, Groups())
        # what went on the channel to the agent: a "p" message each window
        return P.read_message(P.StepPerf, P.read_perf_message(sent[-1]))

    monkeypatch.setattr(perf, "_gpu_signals", lambda index: (1410.0 + index, 66.0))
    sent = []
    got = run(perf.StepMeter(sent.append, "w0", "dp0.pp0.tp0", 0, 4, {}, True, True, gpu=1),
              sent)
    assert (got.gpu_clock_mhz, got.gpu_temp_c) == (1411.0, 66.0)
    assert len(sent) == 1

    calls = []

    def unreadable(index):
        calls.append(index)
        raise ModuleNotFoundError("pynvml")

    monkeypatch.setattr(perf, "_gpu_signals", unreadable)
    sent = []
    meter = perf.StepMeter(sent.append, "w0", "dp0.pp0.tp0", 0, 2, {}, True, True, gpu=0)
    got = run(meter, sent)
    assert (got.gpu_clock_mhz, got.gpu_temp_c) == (None, None)
    assert calls == [0] and len(sent) == 2     # two windows, asked once
    got = run(perf.StepMeter(sent.append, "w0", "dp0.pp0.tp0", 0, 4, {}, True, True), sent)
    assert got.gpu_clock_mhz is None
    # not started by an agent (no channel): nothing to send to, nothing measured for it
    assert not perf.StepMeter(None, "w0", "dp0.pp0.tp0", 0, 4, {}, True, True).publish
