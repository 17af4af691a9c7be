"""The controller is not on the training hot path: when its process dies, training goes on
(the agent hosts the store and the workers), and a new controller resumes from the store.

Each job's controller runs in its own process here, since the faults kill it."""
import json
import os
import subprocess
import sys
import time

import pytest

from trainmover.control.coordinator import Coordinator
from trainmover.core.events import read_jsonl
from trainmover.core.faults import Inject

from mp_harness import wait_for
from test_failures import job, with_faults

RUNNER = ("import json, sys; from trainmover.core.config import JobConfig; "
          "from trainmover.control.coordinator import run_job; from trainmover.core.faults import parse_inject; "
          "run_job(JobConfig.from_dict(json.load(open(sys.argv[1]))), sys.argv[2], quiet=True, "
          "injects=[parse_inject(t) for t in sys.argv[3:]])")


def start_controller(cfg, run_dir, *injects) -> subprocess.Popen:
    os.makedirs(os.path.dirname(run_dir), exist_ok=True)
    path = run_dir + ".json"
    with open(path, "w") as f:
        json.dump(cfg.to_dict(), f)
    return subprocess.Popen([sys.executable, "-c", RUNNER, path, run_dir, *injects],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def events(run_dir, name=None):
    out = read_jsonl(os.path.join(run_dir, "events.jsonl"))
    return [e for e in out if name is None or e["event"] == name]


def steps_done(run_dir):
    return read_jsonl(os.path.join(run_dir, "metrics.jsonl"))


def summary_of(run_dir, timeout_s=240):
    path = os.path.join(run_dir, "summary.json")
    wait_for(lambda: os.path.exists(path), timeout_s, "the job's summary")
    with open(path) as f:
        return json.load(f)


# the tiny model's steps take tens of milliseconds; controllers take seconds (the stragglers'
# tests run as many steps: one uninterrupted run serves both)
STEPS = 160


@pytest.fixture(scope="module")
def baseline(reference_weights):
    return reference_weights(job(steps=STEPS))


@pytest.mark.timeout(400)
def test_controller_crashes_are_survived_and_restarted_automatically(tmp_path, baseline):
    """The controller dies at step 3; a worker crashes while no controller runs; the
    restarted controller finds the crash, recovers it and dies right after sending the plan;
    the survivors carry the plan out on their own; the third controller completes the
    accounting and a scheduled migration. The run ends with the uninterrupted run's
    weights. Every table of the snapshot is kept as parts (as a large job's are), so each
    resumed controller reads them."""
    run_dir = str(tmp_path / "run")
    cfg = with_faults(job(steps=STEPS), Inject("crash", 20, "w1", "backward"))
    cfg.controller.snapshot_part_min_bytes = 0
    proc = start_controller(cfg, run_dir, "crash@3:controller", "crash@20:controller:recovery",
                            "migrate@100:w2")
    assert proc.wait(timeout=200) == -9, proc.stdout.read().decode()[-2000:]
    summary = summary_of(run_dir)
    assert summary["weights_sha256"] == baseline
    assert summary["steps"] == STEPS
    (mig,) = summary["migrations"]
    assert mig["status"] == "done" and mig["pairs"][0]["leaver"] == "w2"
    (rec,) = summary["recoveries"]
    assert rec["failures"] == {"w1": "crash"}
    assert rec["sources"] == {"dp0.pp1.tp0": "replica:w3"}
    lost, resumed = events(run_dir, "controller_lost"), events(run_dir, "controller_resumed")
    assert len(lost) == 2 and len(resumed) == 2
    assert len(events(run_dir, "controller_restarted")) == 2
    # training went on while there was no controller: steps were committed in the gap
    gap = (lost[0]["time"], resumed[0]["time"])
    assert any(gap[0] < m["time"] < gap[1] for m in steps_done(run_dir)), gap
    # and no step was lost or recorded twice
    assert sorted(m["step"] for m in steps_done(run_dir)) == list(range(STEPS))
    from trainmover.control.snapshot_codec import parts_path
    assert os.listdir(parts_path(run_dir))          # the snapshots were kept as parts


@pytest.mark.timeout(400)
def test_a_failure_after_a_controller_kill_aborts_the_right_step(tmp_path):
    """The controller is SIGKILLed at a random moment, long after its last snapshot save
    (saved every 3 s here) while it kept deleting decided steps' keys (every 5 steps); the
    restarted controller must still know the last committed step when a worker crashes
    later. Found by the soak: it resumed from the snapshot's count, could not walk past the
    deleted keys, aborted a step that had committed and sent the job back to it (then: to
    step 1, 250 steps recommitted)."""
    run_dir = str(tmp_path / "run")
    cfg = job(steps=200, controller_gc_every_steps=5, controller_snapshot_interval_s=3.0)
    proc = start_controller(cfg, run_dir)

    def step():
        records = steps_done(run_dir)
        return records[-1]["step"] if records else -1

    wait_for(lambda: step() >= 80, 200, "step 80")
    proc.kill()
    wait_for(lambda: events(run_dir, "controller_resumed"), 100, "a restarted controller")
    wait_for(lambda: step() >= 130, 200, "step 130")
    (pid,) = [e["pid"] for e in events(run_dir, "process_started") if e["name"] == "w1"]
    os.kill(pid, 9)
    summary = summary_of(run_dir)
    (rec,) = summary["recoveries"]
    assert rec["lost_steps"] == 0 and rec["last_committed_step"] >= 130, rec
    assert sorted(m["step"] for m in steps_done(run_dir)) == list(range(200))


@pytest.mark.timeout(400)
def test_controller_dies_mid_migration_and_an_operator_resumes_it(tmp_path, baseline):
    """Manual mode: the controller dies right after ordering a migration's switch; training
    continues through the switch without it; `trainmover controller --resume` finds the
    migration in flight, completes its accounting and runs the job to the end."""
    run_dir = str(tmp_path / "run")
    cfg = job(steps=STEPS, controller_restart="manual")
    proc = start_controller(cfg, run_dir, "migrate@6:w1", "crash@6:controller:migration_switch")
    wait_for(lambda: len(steps_done(run_dir)) >= 1, 120, "the first step")
    with pytest.raises(ValueError, match="is alive"):
        Coordinator.resume(run_dir)            # never two controllers at once
    assert proc.wait(timeout=200) == -9, proc.stdout.read().decode()[-2000:]
    t_dead = time.time()
    # nobody in control, yet the switch happens and steps keep being committed
    wait_for(lambda: any(m["time"] > t_dead for m in steps_done(run_dir)[-1:]) and
             len(steps_done(run_dir)) >= 12, 120, "steps without a controller")
    assert not events(run_dir, "controller_restarted")
    done = subprocess.run([sys.executable, "-m", "trainmover", "controller", "--resume",
                           run_dir, "--quiet"], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout)
    assert summary["weights_sha256"] == baseline
    (mig,) = summary["migrations"]
    assert mig["status"] == "done" and mig["pairs"][0]["leaver"] == "w1"
    assert mig["downtime_s"] is not None
    joiner = mig["pairs"][0]["joiner"]   # the standby that was warm first
    assert joiner in ("s0", "s1") and summary["membership"][joiner] == "dp0.pp1.tp0"


def test_resume_refuses_a_run_dir_without_a_running_job(tmp_path):
    with pytest.raises(ValueError, match="no running job"):
        Coordinator.resume(str(tmp_path))


@pytest.mark.timeout(300)
def test_forged_unsigned_and_malformed_values_neither_stop_stall_nor_alter_the_job(
        tmp_path, reference_weights):
    """Whoever reaches the store's port without the job's secret cannot drive the job. One
    job takes every attack in turn (each used to cost something; one job, since the suite's
    time is mostly jobs starting):

    - a stranger at the port (its number is in ``ps``): torch's own store client and a client
      with a guessed key are hung up on before they can name a key, and the agent says so.

    Then, behind that wall, what a client past it that does not sign (the store's own
    clients can: defense in depth) writes where the job's processes read:

    - unsigned, wrongly signed and replayed requests to the agent, and signed but malformed
      ones, are refused and logged by whoever reads them (the agent, which hosts the store;
      the controller); the request without its incarnation used to kill the agent, and the
      spawn of an arbitrary program is not even expressible;
    - a step's commit decision written before its voters do (the key is guessable): the
      genuine decision replaces an unsigned one, and a reader that meets one ignores it;
    - bumped counters and junk in numbered slots: steps' vote counts bumped both ways (the job
      once stalled, then rolled back), the controller's incarnation (it once stepped down), a
      request number with no request behind it (the controller once blocked on it), junk in
      the agent's queue (the job's shutdown was lost) and in the workers' commands (a
      migration's orders were lost).

    A migration asked for after all of that completes, and the job ends on the uninterrupted
    run's weights, its agent shut down on request."""
    from datetime import timedelta

    import torch.distributed as dist

    from trainmover.api import Job
    from trainmover.control.client import connect, request_migration
    from trainmover.core import kvstore
    from trainmover.core import protocol as P
    from trainmover.core.auth import seal

    run_dir = str(tmp_path / "run")
    assert not os.path.exists(run_dir)
    # the request hole is passed over within a second, while the job still runs: a job
    # three times the others' (at 160 steps it once finished before the migration's turn
    # came, on a quiet machine)
    steps = 3 * STEPS
    cfg = job(steps=steps, controller_request_hole_timeout_s=1.0)
    baseline = reference_weights(cfg)
    job_ = Job(cfg, run_dir, timeout_s=240).start()
    wait_for(lambda: len(steps_done(run_dir)) >= 3, 120, "the first steps")
    assert os.stat(run_dir).st_mode & 0o777 == 0o700
    assert os.stat(os.path.join(run_dir, "secret")).st_mode & 0o777 == 0o600
    signed = connect(run_dir)            # the job's owner: has the secret
    raw = signed.raw                     # past the store's handshake, signing nothing

    # 0. strangers at the port
    with pytest.raises(dist.DistNetworkError):
        dist.TCPStore(raw.host, raw.port, is_master=False, timeout=timedelta(seconds=1))
    with pytest.raises(kvstore.StoreRefused):
        kvstore.connect(raw.host, raw.port, b"a guess" * 8, 5.0)
    # and at the host's door to it (its port: any local user can scan for it)
    (door,) = [e["door"] for e in events(run_dir, "agent_started")]
    host, _, port = door.rpartition(":")
    with pytest.raises(dist.DistNetworkError):
        dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=1))
    with pytest.raises(kvstore.StoreRefused):
        kvstore.connect(host, int(port), b"a guess" * 8, 5.0)
    wait_for(lambda: events(run_dir, "store_connections_refused"), 60, "the refusals reported")

    # 1. forged and malformed requests
    kill = '{"type": "signal", "name": "w1", "incarnation": 1, "signal": "KILL"}'
    spawn = '{"type": "spawn", "name": "x", "incarnation": 1, "argv": ["touch", "x"]}'
    refused = []

    def agent_request(value, writer=raw):
        index = raw.add(P.agent_key(0, "req/count"), 1)
        writer.set(P.agent_request_key(0, index), value)
        refused.append(P.agent_request_key(0, index))

    agent_request(kill)                                                 # unsigned
    agent_request(seal(b"0" * 64, "agent/0/req/0", kill))               # wrong secret
    # a valid request of this job replayed at another index: the MAC covers the key
    agent_request(raw.get(P.agent_request_key(0, 1)))
    agent_request(spawn, signed)                                        # signed, malformed
    agent_request('{"type": "signal", "name": "w1", "signal": "KILL"}', signed)  # no incarnation
    index = raw.add(P.REQUEST_COUNT_KEY, 1)
    signed.set(P.request_key(index), '{"workers": "w1"}')            # malformed ask
    refused.append(P.request_key(index))
    answer = request_migration(run_dir, ["w7"], timeout_s=60)   # a well-formed bad request
    assert answer["status"] == "refused" and "w7" in answer["reason"]

    # 2. unsigned commit decisions for every coming step
    first = len(steps_done(run_dir)) + 2
    for step in range(first, steps):
        raw.set(P.commit_key(0, step, "decision"), "commit" if step % 2 else "abort")

    # 3. counters bumped, numbered slots filled with junk
    for _ in range(4):
        raw.add(P.CONTROLLER_INCARNATION_KEY, 1)
    raw.add(P.REQUEST_COUNT_KEY, 1)                       # a request nobody writes
    # vote counters of coming steps bumped down (nobody reaches the count) and up (a voter
    # reaches it early: it checks the ballots)
    ahead = len(steps_done(run_dir)) + 3
    for step in range(ahead, ahead + 3):
        raw.add(P.commit_key(0, step, "votes"), -1)
        raw.add(P.commit_key(0, step + 3, "votes"), 1)
    head = raw.add(P.agent_key(0, "req/count"), 0) + 1
    for i in range(head, head + 20):
        raw.set(P.agent_request_key(0, i), "junk")
    for i in range(1, 41):                    # the processes' commands, through the agent
        raw.set(P.host_command_key(0, i), "junk")

    answer = request_migration(run_dir, ["w1"], timeout_s=120)
    assert answer["status"] == "done", answer
    summary = job_.wait(240)
    assert summary["weights_sha256"] == baseline and summary["steps"] == steps
    assert [m["status"] for m in summary["migrations"]] == ["done"]
    assert summary["recoveries"] == []
    (stopped,) = events(run_dir, "agent_stopped")
    assert stopped["reason"] == "requested", stopped
    assert events(run_dir, "request_skipped")
    # each forged or malformed request refused, and logged once, by the process that read it
    rejected = {e["key"]: e for e in events(run_dir, "message_rejected")}
    assert [rejected[k]["worker"] for k in refused] == ["agent"] * 5 + ["coordinator"], rejected
    errors = " | ".join(rejected[k]["error"] for k in refused)
    assert "not signed" in errors and "bad signature" in errors
    assert "unknown field(s) ['argv']" in errors and "missing 1 required" in errors
    assert not os.path.exists(os.path.join(run_dir, "x"))


@pytest.mark.timeout(200)
def test_junk_at_the_stop_request_does_not_disable_trainmover_stop(tmp_path):
    from trainmover.api import Job
    from trainmover.control.client import connect, request_stop
    from trainmover.core import protocol as P

    run_dir = str(tmp_path / "run")
    job_ = Job(job(steps=STEPS, standbys=0), run_dir, timeout_s=180).start()
    wait_for(lambda: len(steps_done(run_dir)) >= 3, 120, "the first steps")
    connect(run_dir).raw.set(P.STOP_REQUEST_KEY, "junk")
    wait_for(lambda: events(run_dir, "message_rejected"), 30, "the junk refused")
    summary = request_stop(run_dir, timeout_s=120)
    assert summary.get("stopped") is True and summary["steps"] < STEPS, summary
    job_.wait(60)


def test_of_two_controllers_registering_together_the_older_steps_down():
    """The controller's own agent restarts it while a successor host takes over: two
    controllers take incarnations 3 and 4; whichever writes its record last, the one of
    incarnation 4 is the job's and 3 steps down (both once ran: 4 wrote first, 3
    overwrote it, and neither read an incarnation above its own)."""
    from types import SimpleNamespace

    from trainmover.control.coordinator import Superseded
    from trainmover.core import protocol as P
    from trainmover.core.auth import AuthStore

    class Raw:                         # compare-and-set as the stores do it
        def __init__(self):
            self.kv = {}

        def compare_set(self, key, expected, desired):
            expected = expected.encode() if isinstance(expected, str) else expected
            desired = desired.encode() if isinstance(desired, str) else desired
            if self.kv.get(key, b"") == expected:
                self.kv[key] = desired
            return self.kv.get(key, expected)

        def get(self, key):
            return self.kv[key]

    def controller(store, incarnation, pid):
        c = object.__new__(Coordinator)
        c.ctx, c.incarnation, c.node = SimpleNamespace(store=store), incarnation, 1
        os_getpid = os.getpid
        os.getpid = lambda: pid
        try:
            c._register()
        finally:
            os.getpid = os_getpid
        return c

    def record(store):
        return P.read_message(P.ControllerInfo, store.get(P.CONTROLLER_KEY))

    for first, second in ((4, 3), (3, 4), (2, 3)):
        store = AuthStore(Raw(), b"k" * 32)
        store.raw.kv[P.CONTROLLER_KEY] = b"forged"     # junk there is replaced
        controller(store, first, 1000 + first)
        if second < first:
            with pytest.raises(Superseded):
                controller(store, second, 1000 + second)
        else:
            controller(store, second, 1000 + second)
        newest = max(first, second)
        assert (record(store).incarnation, record(store).pid) == (newest, 1000 + newest)
