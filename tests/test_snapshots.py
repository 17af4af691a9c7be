"""In-memory peer snapshots: the holder and its wire protocol, the choice of a usable
snapshot, the recovery plan's source order, and a pipeline-only job recovered from memory
bit-identical to its uninterrupted run."""
import os
import socket

import pytest

from trainmover.agent.snapshots import SnapshotServer
from trainmover.control.coordinator import run_job
from trainmover.core import decisions as C
from trainmover.core import snapshots as S
from trainmover.core.events import read_jsonl
from trainmover.core.faults import Inject
from trainmover.core.topology import Layout

from test_controller import membership
from test_failures import job, with_faults

SECRET = b"k" * 32


@pytest.fixture
def server():
    errors = []
    srv = SnapshotServer("127.0.0.1", SECRET, keep=2, io_timeout_s=5.0,
                         on_error=errors.append).start()
    srv.errors = errors
    yield srv
    srv.stop()


def client(srv, secret=SECRET):
    return S.SnapshotClient(srv.address, secret, 2.0, 5.0)


@pytest.mark.timeout(30)
def test_put_get_list_round_trip(server):
    c = client(server)
    c.put("dp0.pp0.tp0", 10, 1, b"state-10")
    c.put("dp0.pp1.tp0", 10, 1, b"other")
    entry, blob = c.get("dp0.pp0.tp0", 10, 1 << 20)
    assert bytes(blob) == b"state-10" and (entry.step, entry.epoch, entry.bytes) == (10, 1, 8)
    assert sorted((e.role, e.step) for e in c.list()) == [("dp0.pp0.tp0", 10),
                                                          ("dp0.pp1.tp0", 10)]
    with pytest.raises(S.SnapshotUnavailable, match="no snapshot of dp0.pp0.tp0 at step 20"):
        c.get("dp0.pp0.tp0", 20, 1 << 20)


@pytest.mark.timeout(30)
def test_holder_keeps_the_newest_steps_and_the_newest_epoch(server):
    c = client(server)
    for step in (0, 10, 20):
        c.put("r", step, 1, f"s{step}".encode())
    assert sorted(e.step for e in c.list()) == [10, 20]     # keep=2: step 0 dropped
    c.put("r", 20, 3, b"replayed")     # the same step taken again after a rollback
    c.put("r", 20, 2, b"late")         # a late send from an older epoch: ignored
    entry, blob = c.get("r", 20, 1 << 20)
    assert (entry.epoch, bytes(blob)) == (3, b"replayed")
    assert server.holder.held_bytes() == len(b"s10") + len(b"replayed")


@pytest.mark.timeout(30)
def test_holder_refuses_a_client_without_the_secret_and_keeps_serving(server):
    with pytest.raises(S.SnapshotUnavailable):
        client(server, secret=b"x" * 32).put("r", 10, 1, b"forged")
    # a frame whose payload does not match its sealed sha256
    with socket.create_connection(tuple(server.server_address[:2])) as sock:
        S.send_frame(sock, SECRET, S.KEY_REQUEST,
                     S.encode(S.Request("put", "r", 10, 1, 4, "0" * 64)), b"evil")
        header, _ = S.recv_frame(sock, SECRET, S.KEY_REPLY, 0)
    assert not S.decode_reply(header).ok
    # garbage bytes
    with socket.create_connection(tuple(server.server_address[:2])) as sock:
        sock.sendall(b"\x00" * 16 + b"garbage")
    assert client(server).list() == []       # nothing stored, still serving
    assert server.errors                      # the forged request was reported


@pytest.mark.timeout(30)
def test_a_snapshot_altered_in_the_holder_is_refused_by_the_fetcher(server):
    c = client(server)
    c.put("r", 10, 1, b"good state")
    entry, blob = server.holder.get("r", 10)
    blob[0:4] = b"evil"                      # memory corruption in the holder
    with pytest.raises(S.SnapshotUnavailable, match="altered"):
        c.get("r", 10, 1 << 20)


def E(role, step, epoch=1):
    return S.Entry(role, step, epoch, 1, "0" * 64)


def test_usable_snapshot_needs_every_role_in_one_epoch():
    roles = ["a", "b"]
    held = {"h1:1": [E("a", 10), E("a", 20), E("a", 30, epoch=2)],
            "h2:2": [E("b", 10), E("b", 20, epoch=2), E("b", 30, epoch=2)]}
    # 30: both in epoch 2; bounded by the last committed step
    assert S.usable_snapshot(held, roles, 40) == (30, {"a": "h1:1", "b": "h2:2"})
    # 20: a's in epoch 1, b's in epoch 2 (not one cut) -> 10
    assert S.usable_snapshot(held, roles, 29) == (10, {"a": "h1:1", "b": "h2:2"})
    assert S.usable_snapshot(held, roles, 9) is None
    assert S.usable_snapshot({"h1:1": [E("a", 10)]}, roles, 40) is None   # b missing


@pytest.mark.parametrize("snap,ckpt,expect", [
    (20, 10, (20, "snapshot")), (10, 20, (20, "checkpoint")), (20, 20, (20, "snapshot")),
    (20, None, (20, "snapshot")), (None, 0, (0, "checkpoint"))])
def test_plan_takes_the_newest_source_snapshot_on_a_tie(snap, ckpt, expect):
    m = membership(Layout(1, 2, 1), standbys=1)
    plan = C.plan_recovery(m, 1, ["w1"], set(), ckpt, snapshot_step=snap)
    assert (plan.rollback_step, plan.rollback_source) == expect
    assert set(plan.sources.values()) == {expect[1]}


def test_plan_without_any_source_is_impossible():
    m = membership(Layout(1, 2, 1), standbys=1)
    with pytest.raises(C.RecoveryImpossible, match="no complete snapshot or checkpoint"):
        C.plan_recovery(m, 1, ["w1"], set(), None, snapshot_step=None)


@pytest.fixture(scope="module")
def dp1_baseline(tmp_path_factory):
    root = tmp_path_factory.mktemp("dp1")
    cfg = job(dp=1, pp=2, steps=24, standbys=1, snapshot_every=5, checkpoint_every=50)
    return run_job(cfg, str(root / "run"), quiet=True, timeout_s=300)["weights_sha256"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("victim", ["w0", "w1"], ids=["first-stage", "last-stage"])
def test_pipeline_only_job_recovers_from_a_peer_snapshot(tmp_path, dp1_baseline, victim):
    """DP1 x PP2, snapshots every 5 steps, disk checkpoints only of the initial state: a
    crash in step 13 rolls both stages back to the step-10 snapshot, fetched from memory
    (no role file is read), and the run ends with the uninterrupted run's weights."""
    cfg = with_faults(job(dp=1, pp=2, steps=24, standbys=1, snapshot_every=5,
                          checkpoint_every=50), Inject("crash", 13, victim, "forward"))
    run_dir = str(tmp_path / "run")
    summary = run_job(cfg, run_dir, quiet=True, timeout_s=300)
    (rec,) = summary["recoveries"]
    assert rec["rollback_source"] == "snapshot" and rec["rollback_step"] == 10
    assert set(rec["sources"].values()) == {"snapshot"}
    assert 0 < rec["lost_steps"] <= 5
    events = read_jsonl(os.path.join(run_dir, "events.jsonl"))
    fetched = sorted(e["worker"] for e in events if e["event"] == "snapshot_fetched")
    survivor = "w1" if victim == "w0" else "w0"
    assert fetched == sorted([survivor, rec["pairs"][0]["joiner"]])
    assert summary["weights_sha256"] == dp1_baseline
