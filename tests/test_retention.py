"""A long job's store stays the size of a short one's: the keys of decided steps, finished
migrations and recoveries, and exited processes' heartbeats are deleted
(``control/retention.py``); training is unaffected (same weights as without deletion)."""
import pytest

from mp_harness import wait_for
from test_failures import with_faults
from trainmover.api import Job
from trainmover.control.coordinator import run_job
from trainmover.core.faults import Inject
from trainmover.core.topology import Layout
from trainmover.recipes import get_recipe

STEPS = 200


def job(**settings):
    cfg = get_recipe("tiny")
    cfg.layout = Layout(2, 2, 1)
    cfg.train.steps = STEPS
    cfg.train.threads_per_worker = 1
    cfg.override(standby_count=2, controller_gc_every_steps=20,
                 health_heartbeat_timeout_s=2.0, recovery_report_timeout_s=4.0)
    return cfg.override(**settings).validate()


@pytest.mark.timeout(400)
# the comparison with a job whose store is never collected is a second long job: slow suite
@pytest.mark.parametrize("against_no_gc", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["keys", "keys-and-weights-of-a-job-without-gc"])
def test_store_keys_stay_flat_through_steps_a_migration_and_a_recovery(tmp_path,
                                                                       against_no_gc):
    plain = run_job(job(controller_gc_every_steps=0), str(tmp_path / "plain"), quiet=True,
                    timeout_s=300) if against_no_gc else None
    cfg = with_faults(job(), Inject("crash", 120, "w3", "backward"))
    j = Job(cfg, str(tmp_path / "run"), timeout_s=300,
            injects=[Inject("migrate", 60, "w1")]).start()
    coord = j.coordinator
    keys = {}

    def sample(at):
        wait_for(lambda: coord.progress.last_step >= at, 200, f"step {at}")
        keys[at] = coord.ctx.store.raw.num_keys()
        return True

    sample(40)
    sample(STEPS - 20)
    summary = j.wait(300)
    if plain is not None:
        assert summary["weights_sha256"] == plain["weights_sha256"]
    assert [m["status"] for m in summary["migrations"]] == ["done"]
    assert len(summary["recoveries"]) == 1
    # 140 steps at 3 keys each would add 420 keys; what remains is bounded by processes
    # and events (the migration's and recovery's commands, new groups' rendezvous keys)
    assert keys[STEPS - 20] - keys[40] < 120, keys


def test_the_controller_keeps_a_bounded_tail_of_the_metrics(tmp_path):
    """The controller's memory does not grow with the step count: it keeps the newest
    records only (the file keeps every one)."""
    import json

    from trainmover.control.context import RECORDS_KEPT, Progress

    path = tmp_path / "metrics.jsonl"
    progress = Progress(str(path), 0, enabled=False)
    with open(path, "w") as f:
        for step in range(5 * RECORDS_KEPT + 7):
            f.write(json.dumps({"step": step, "time": float(step), "step_time_s": 0.1,
                                "worker": "w0"}) + "\n")
            if step % 997 == 0:
                f.flush()
                progress.poll()
    progress.poll()
    assert progress.last_step == 5 * RECORDS_KEPT + 6
    assert RECORDS_KEPT <= len(progress.records) <= 2 * RECORDS_KEPT
    steps = [r["step"] for r in progress.records]
    assert steps == list(range(steps[0], 5 * RECORDS_KEPT + 7))


@pytest.mark.slow   # in `make test-slow`: a sibling in the default suite covers its mechanism
@pytest.mark.timeout(400)
def test_store_keys_do_not_grow_with_events(tmp_path):
    """Migrations and crashes, with the standby pool replenished, leave nothing behind per
    event: commands, agent requests and exit records, the replaced communicators'
    rendezvous keys and the departed processes' own keys are deleted. Sampled after the
    first event and after the fifth: the same count within a few keys (the second crash
    fault's "fired" marker, the steps in flight; one event left behind would be tens)."""
    injects = [Inject("migrate", 100, "w0"), Inject("migrate", 200, "w1"),
               Inject("migrate", 300, "w2")]
    # decided steps' keys deleted every step: their sawtooth (3 keys a step) would otherwise
    # hide what events leave behind
    cfg = with_faults(job(standby_replenish=True, controller_gc_every_steps=1),
                      Inject("crash", 240, "w3", "forward"), Inject("crash", 330, "w3",
                                                                   "forward"))
    j = Job(cfg, str(tmp_path / "run"), timeout_s=350, injects=injects).start()
    coord = j.coordinator
    keys = {}

    def settled(after_events: int) -> bool:
        done = len(coord.migrations.finished) + len(coord.recovery.done)
        return done >= after_events and coord.migrations.active is None and \
            coord.recovery.active is None and not coord.recovery.awaiting

    wait_for(lambda: settled(1) and coord.progress.last_step >= 150, 250, "the first event")
    keys["first"] = coord.ctx.store.raw.num_keys()
    wait_for(lambda: settled(4) and coord.progress.last_step >= STEPS - 30, 300,
             "the other events")
    keys["last"] = coord.ctx.store.raw.num_keys()
    summary = j.wait(300)
    events = [m["status"] for m in summary["migrations"]] + \
        [r["status"] for r in summary["recoveries"]]
    assert events.count("done") >= 4, summary["migrations"]
    assert abs(keys["last"] - keys["first"]) < 12, keys


class DeletingStore:
    """Records the keys a ``Retention`` deletes."""

    def __init__(self):
        self.deleted = []

    def delete_key(self, key):
        self.deleted.append(key)
        return True

    def delete_keys(self, keys):
        self.deleted.extend(keys)
        return len(keys)


def test_keys_go_only_once_the_snapshot_that_no_longer_needs_them_is_saved():
    """A controller that completes a recovery and dies before its next snapshot save is
    resumed from a snapshot where that recovery still waits for its recovered count: the
    count must still be there (it once was deleted at once, and the resumed controller
    waited for it until the job's timeout: CI, a controller killed 0.1 s after the
    recovery)."""
    from types import SimpleNamespace

    from trainmover.control.retention import Retention
    from trainmover.core import protocol as P

    store = DeletingStore()
    membership = SimpleNamespace(generations={}, standbys={}, workers={})
    ret = Retention(SimpleNamespace(store=store, membership=membership,
                                    cfg=SimpleNamespace(comm=SimpleNamespace(backend="auto")),
                                    procs=SimpleNamespace(nnodes=2)))
    ret.recovery_done(7, [1], ["w0", "w1"], failed=["w1"])
    ret.migration_done(2, ["w0"], [])
    assert store.deleted == []
    ret.snapshot_saved(exits_seen=1)
    assert P.recovered_count_key(7) in store.deleted
    assert P.failure_key(1, "w0") in store.deleted and P.membership_key("w1") in store.deleted
    assert P.host_reports_key(1, 1) in store.deleted
    assert P.mig_key(2, "go") in store.deleted and P.agent_exit_key(1) in store.deleted
    store.deleted.clear()
    ret.snapshot_saved(exits_seen=1)
    assert store.deleted == []           # each key once


@pytest.mark.parametrize("backend", ["gloo", "nccl", "auto"])
def test_a_replaced_communicators_rendezvous_keys_go_as_its_backend_left_them(backend):
    """gloo's full mesh leaves one key a member, NCCL one unique id: a replaced generation's
    are deleted (both forms where the controller cannot tell, "auto"), each once, and a
    transfer channel's with them; the live generation's stay."""
    from types import SimpleNamespace

    from trainmover.control.retention import Retention
    from trainmover.core import protocol as P
    from trainmover.core.topology import Layout

    store, layout = DeletingStore(), Layout(dp=4, pp=1, tp=1)
    name = next(n for n, g in layout.communicator_groups().items() if g.size == 4)
    membership = SimpleNamespace(generations={name: 2}, standbys={}, workers={}, layout=layout)
    ret = Retention(SimpleNamespace(store=store, membership=membership,
                                    cfg=SimpleNamespace(comm=SimpleNamespace(backend=backend)),
                                    procs=SimpleNamespace(nnodes=1)))
    ret.replaced_groups([("xfer.w0-s0", 0)])
    ret.snapshot_saved(exits_seen=0)
    gloo = {k for gen in (0, 1) for k in P.rendezvous_keys(name, gen, 4)} | \
        set(P.rendezvous_keys("xfer.w0-s0", 0, 2))
    nccl = {P.nccl_id_key(name, 0), P.nccl_id_key(name, 1), P.nccl_id_key("xfer.w0-s0", 0)}
    want = {"gloo": gloo, "nccl": nccl, "auto": gloo | nccl}[backend]
    assert sorted(store.deleted) == sorted(want)
    assert not any("gen2" in k for k in store.deleted)
    store.deleted.clear()
    ret.replaced_groups()
    ret.snapshot_saved(exits_seen=0)
    assert store.deleted == []
