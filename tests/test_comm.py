"""Communication layer with real processes on a local TCPStore (gloo)."""
import os
import signal
import threading
import time

import pytest
import torch

from mp_harness import run_processes, values
from trainmover.comm.groups import (CommError, DeviceMismatch, GroupBuilder, StoreClients,
                                    build_comm_groups)
from trainmover.core.topology import Layout, Role

LAYOUT = Layout(2, 1, 2)  # 4 processes: two TP pairs, two DP pairs


def _builder(address, timeout_s=30.0):
    return GroupBuilder(StoreClients(address), torch.device("cpu"), timeout_s)


def _collectives(rank, address):
    role = LAYOUT.role_of(rank)
    groups, times = build_comm_groups(_builder(address), LAYOUT, role)
    t = torch.tensor([float(rank)])
    groups.tp.allreduce(t)
    d = torch.tensor([float(rank)])
    groups.dp.allreduce(d)
    b = torch.tensor([float(rank)])
    groups.tp.broadcast(b, src=0)
    gathered = [float(x) for x in groups.dp.allgather(torch.tensor([float(rank)]))]
    groups.shutdown()
    return float(t), float(d), float(b), gathered, sorted(times)


@pytest.mark.timeout(120)
def test_groups_without_a_global_world():
    res = values(run_processes(_collectives, 4))
    for rank, (t, d, b, gathered, names) in res.items():
        role = LAYOUT.role_of(rank)
        tp_peers = [LAYOUT.global_rank(m) for m in LAYOUT.tp_group(role).members]
        dp_peers = [LAYOUT.global_rank(m) for m in LAYOUT.dp_group(role).members]
        assert t == sum(tp_peers) and d == sum(dp_peers)
        assert b == tp_peers[0]
        assert gathered == [float(r) for r in dp_peers]
        assert names == sorted(LAYOUT.groups_of(role)[s].name for s in ("tp", "dp", "pp"))


def _rebuild_one(rank, address):
    """dp0's TP group moves to generation 1 in a background thread (its own store client)
    while every process keeps running DP all-reduces on untouched generation-0 groups."""
    role = LAYOUT.role_of(rank)
    builder = _builder(address)
    groups, _ = build_comm_groups(builder, LAYOUT, role)
    rebuilds = role.dp == 0
    new = {}
    if rebuilds:
        spec = LAYOUT.tp_group(role)
        th = threading.Thread(target=lambda: new.update({spec.name: builder.build(spec, role, 1)}))
        th.start()
    dp_results = []
    for i in range(20):  # training traffic meanwhile, on groups that are not rebuilt
        x = torch.tensor([float(i + rank)])
        groups.dp.allreduce(x)
        dp_results.append(float(x))
    old_tp = groups.tp
    if rebuilds:
        th.join()
        # switch at a boundary: nothing is pending on the old group any more
        replaced = groups.install(new)
        assert replaced == [old_tp]
        for g in replaced:
            g.shutdown()
    t = torch.tensor([float(rank)])
    groups.tp.allreduce(t)
    gens = groups.generations()
    old_closed = old_tp.closed
    groups.shutdown()
    return dp_results, float(t), gens, old_closed


@pytest.mark.timeout(120)
def test_rebuild_one_group_while_others_keep_working():
    res = values(run_processes(_rebuild_one, 4))
    for rank, (dp_results, t, gens, old_closed) in res.items():
        role = LAYOUT.role_of(rank)
        peers = [LAYOUT.global_rank(m) for m in LAYOUT.dp_group(role).members]
        assert dp_results == [float(sum(i + p for p in peers)) for i in range(20)]
        tp_peers = [LAYOUT.global_rank(m) for m in LAYOUT.tp_group(role).members]
        assert t == sum(tp_peers)
        tp_name = LAYOUT.tp_group(role).name
        assert gens[tp_name] == (1 if role.dp == 0 else 0)
        assert gens[LAYOUT.dp_group(role).name] == 0
        assert old_closed == (role.dp == 0)


def _peer_dies(rank, address, size, victim):
    from trainmover.core.topology import GroupSpec

    spec = GroupSpec("test.kill", "tp", tuple(Role(0, 0, i) for i in range(size)))
    group = _builder(address, timeout_s=8.0).build(spec, Role(0, 0, rank), 0)
    x = torch.ones(4)
    group.allreduce(x)  # everyone is connected
    if rank == victim:
        time.sleep(0.5)  # the others are blocked inside the next all-reduce by now
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        group.allreduce(torch.ones(1 << 16))
    except CommError as exc:
        return "error", time.monotonic() - t0, str(exc), group.error is not None
    return "completed", time.monotonic() - t0, "", False


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [2, 3])
def test_killed_peer_mid_collective_raises_not_hangs(size):
    res = run_processes(_peer_dies, size, size, size - 1, timeout=60, expect=size - 1)
    for rank in range(size - 1):
        status, (outcome, elapsed, message, recorded) = res[rank]
        assert status == "ok"
        assert outcome == "error", (rank, outcome)
        assert "test.kill gen0" in message and recorded
        assert elapsed < 8.0 + 4.0  # at worst the group timeout, never a hang


def _staged_ops(rank, address):
    """Every operation through host staging (the mode of workers sharing a GPU over gloo),
    here with CPU tensors so it runs anywhere: the result must land in the caller's tensor,
    for synchronous and asynchronous operations and point-to-point receives alike."""
    builder = _builder(address)
    builder.stage = True
    role = LAYOUT.role_of(rank)
    groups, _ = build_comm_groups(builder, LAYOUT, role)
    assert groups.dp.stage and groups.tp.stage
    a = torch.tensor([float(rank), 1.0])
    work = groups.dp.allreduce(a, async_op=True)
    unchanged_before_wait = a.tolist()
    work.wait()
    b = torch.tensor([float(rank)])
    groups.tp.broadcast(b, src=1)
    gathered = [float(x) for x in groups.tp.allgather(torch.tensor([float(rank)]))]
    peer = 1 - groups.dp.rank
    out = torch.zeros(3)
    if groups.dp.rank == 0:
        groups.dp.send(torch.tensor([1.0, 2.0, float(rank)]), peer).wait()
    else:
        groups.dp.recv(out, peer).wait()
    groups.shutdown()
    return unchanged_before_wait, a.tolist(), float(b), gathered, out.tolist()


@pytest.mark.timeout(120)
def test_host_staged_operations_write_back_into_the_callers_tensors():
    res = values(run_processes(_staged_ops, 4))
    for rank, (before, a, b, gathered, out) in res.items():
        role = LAYOUT.role_of(rank)
        tp_peers = [LAYOUT.global_rank(m) for m in LAYOUT.tp_group(role).members]
        dp_peers = [LAYOUT.global_rank(m) for m in LAYOUT.dp_group(role).members]
        # an asynchronous operation on a staged tensor is copied back at its wait
        assert before == [float(rank), 1.0]
        assert a == [float(sum(dp_peers)), 2.0]
        assert b == tp_peers[1]
        assert gathered == [float(r) for r in tp_peers]
        if rank == dp_peers[1]:
            assert out == [1.0, 2.0, float(dp_peers[0])]


def _late_peer(rank, address):
    """Rank 0 abandons an all-reduce of its gradient bucket (its peer is cut off) and
    quarantines the buckets, as a surviving worker does; then the peer's data arrives after
    all and the operation completes."""
    from trainmover.core.topology import GroupSpec
    from trainmover.train.buckets import GradBuckets

    builder = _builder(address)
    spec = GroupSpec("dp.test", "dp", (Role(0, 0, 0), Role(1, 0, 0)))
    group = builder.build_ranked(spec, rank, 0)
    store = StoreClients(address).get()
    if rank == 1:
        store.wait(["go"])
        group.allreduce(torch.full((4,), 5.0))
        return None
    p = torch.nn.Parameter(torch.zeros(4))

    class Groups:
        dp = group

    buckets = GradBuckets([p], 1 << 20, Groups())
    buckets.buffers[0].fill_(1.0)
    work = group.allreduce(buckets.buffers[0], async_op=True)   # the peer is not there yet
    old = buckets.buffers[0]
    buckets.quarantine()
    store.set("go", "1")
    work.wait()                                                 # the late data arrived
    return old.tolist(), p.grad.tolist(), buckets.buffers[0].data_ptr() == p.grad.data_ptr()


@pytest.mark.timeout(120)
def test_an_abandoned_allreduce_that_completes_late_cannot_touch_live_gradients():
    old, grad, grad_in_bucket = values(run_processes(_late_peer, 2))[0]
    assert old == [6.0] * 4          # the late completion wrote into the old buffer ...
    assert grad == [0.0] * 4         # ... never into the gradients in use
    assert grad_in_bucket


def _checked(rank, address):
    """comm.check_devices: tensors on the group's device pass every operation; one on
    another device is refused by name before anything is issued, so the group stays usable."""
    from trainmover.core.topology import GroupSpec
    builder = GroupBuilder(StoreClients(address), torch.device("cpu"), 30.0, check_devices=True)
    spec = GroupSpec("dp.check", "dp", (Role(0, 0, 0), Role(1, 0, 0)))
    group = builder.build_ranked(spec, rank, 0)
    refused = []
    for op in ("allreduce", "broadcast", "allgather", "send", "recv"):
        elsewhere = torch.empty(2, device="meta")
        args = {"broadcast": (0,), "send": (1 - rank,), "recv": (1 - rank,)}.get(op, ())
        try:
            getattr(group, op)(elsewhere, *args)
        except DeviceMismatch as exc:
            refused.append(str(exc))
    issued_after_refusals = dict(group.issued)
    t = torch.tensor([float(rank + 1)])
    group.allreduce(t)
    gathered = [float(x) for x in group.allgather(torch.tensor([float(rank)]))]
    box = torch.zeros(1)
    if rank == 0:
        group.send(torch.tensor([7.0]), 1).wait()
    else:
        group.recv(box, 0).wait()
    trivial = builder.build_ranked(GroupSpec("tp.check", "tp", (Role(0, 0, 0),)), 0, 0)
    try:
        trivial.allreduce(torch.empty(1, device="meta"))
        trivial_refused = False
    except DeviceMismatch:
        trivial_refused = True
    group.shutdown()
    return refused, issued_after_refusals, float(t), gathered, float(box), trivial_refused


@pytest.mark.timeout(120)
def test_a_tensor_on_another_device_is_refused_before_it_reaches_the_backend():
    res = values(run_processes(_checked, 2))
    for rank, (refused, issued, total, gathered, box, trivial_refused) in res.items():
        assert len(refused) == 5
        for op, msg in zip(("allreduce", "broadcast", "allgather", "send", "recv"), refused):
            assert msg == (f"{op} on group dp.check: a tensor on meta, but the group's device "
                           f"is cpu")
        assert issued == {"coll": 0, "sent": 0, "recv": 0}
        assert total == 3.0 and gathered == [0.0, 1.0]
        if rank == 1:
            assert box == 7.0
        assert trivial_refused
