"""trainmover's groups as torch.distributed process groups (comm/torch_groups.py): a group
object held by user code, by DDP, by a DeviceMesh or by FSDP2 before a switch serves the new
generation after it; a dead peer never blocks a survivor inside a step."""
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from mp_harness import run_processes, values
from trainmover.comm.groups import AbortSignal, GroupBuilder, StoreClients, build_comm_groups
from trainmover.core.topology import Layout, Role

LAYOUT = Layout(2, 1, 1)
STAYER, LEAVER, JOINER = 0, 1, 2
VALUE = {STAYER: 1.0, LEAVER: 10.0, JOINER: 100.0}


@pytest.fixture(scope="module", autouse=True)
def built_extension():
    # built once here, as the launcher does before any worker starts
    from trainmover.comm import native

    native.ensure_built()


def _torch_groups(address, role, generation, joining=False):
    from trainmover.comm.torch_groups import TorchGroups

    sig = AbortSignal()
    builder = GroupBuilder(StoreClients(address), torch.device("cpu"), 30.0, abort_signal=sig)
    groups, _ = build_comm_groups(builder, LAYOUT, role,
                                  {n: generation for n in LAYOUT.communicator_groups()})
    tg = TorchGroups(groups, LAYOUT, role, sig, torch.device("cpu"), joining=joining)
    return builder, groups, tg, sig


def _uses(pg, model, mesh, fsdp, value):
    """One use of every kind of holder: dist.* on the group and the default group, a DDP
    step, a DTensor gather over the mesh, an FSDP2 step. Returns what each gave."""
    from torch.distributed.tensor import Shard, distribute_tensor

    out = {}
    t = torch.tensor([value])
    dist.all_reduce(t, group=pg)
    out["all_reduce"] = t.item()
    t = torch.tensor([value])
    dist.all_reduce(t)                      # the default group (the world is the dp axis)
    out["world"] = t.item()
    model.zero_grad()
    model(torch.full((1, 2), value)).sum().backward()
    out["ddp_grad"] = model.module.weight.grad.sum().item()
    local = torch.full((1,), value)
    x = distribute_tensor(torch.zeros(2), mesh, [Shard(0)])
    x.to_local().copy_(local)
    out["dtensor"] = x.full_tensor().tolist()
    fsdp.zero_grad()
    fsdp(torch.full((1, 2), value)).sum().backward()
    out["fsdp_grad"] = fsdp.weight.grad.full_tensor().sum().item()
    return out


def _holders(tg):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    pg = tg.process_groups["dp"]
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1), process_group=pg)
    mesh = DeviceMesh.from_group(pg, "cpu")
    torch.manual_seed(0)
    fsdp = torch.nn.Linear(2, 2)
    fully_shard(fsdp, mesh=mesh)
    return pg, model, mesh, fsdp


def _migration(rank, address):
    store = StoreClients(address).raw()
    role = Role(0 if rank == STAYER else 1, 0, 0)
    if rank == JOINER:
        # the joiner's process groups are built on generation 1 once the leaver is gone
        store.wait(["left"])
        _, _, tg, _ = _torch_groups(address, role, 1, joining=True)
        holders = _holders(tg)
        # set-up and two steps answered locally (DDP's start-up broadcast, and the bucket
        # rebuild it does once after its first step: the stayers did theirs long ago)
        for _ in range(2):
            _uses(*holders, VALUE[rank])
        tg.live()
        return {"after": _uses(*holders, VALUE[rank])}
    builder, groups, tg, _ = _torch_groups(address, role, 0)
    holders = _holders(tg)
    before = _uses(*holders, VALUE[rank])
    before = _uses(*holders, VALUE[rank])     # DDP's second step rebuilds its buckets
    if rank == LEAVER:
        groups.shutdown()
        store.set("left", "1")
        return {"before": before}
    spec = LAYOUT.dp_group(role)
    new = builder.build(spec, role, 1)       # rendezvous with the joiner
    for old in groups.install({spec.name: new}):
        old.shutdown()
    after = _uses(*holders, VALUE[rank])
    return {"before": before, "after": after, "generation": tg.generation("dp"),
            "accounting": groups.dp.accounting()}


@pytest.mark.timeout(180)
def test_process_groups_held_before_a_switch_serve_the_new_generation_after_it():
    res = values(run_processes(_migration, 3, timeout=150))
    stayer, joiner = res[STAYER], res[JOINER]
    before = VALUE[STAYER] + VALUE[LEAVER]
    after = VALUE[STAYER] + VALUE[JOINER]
    assert stayer["before"]["all_reduce"] == stayer["before"]["world"] == before
    # the stayer's group, default group, DDP model, mesh and FSDP module were all made before
    # the switch; after it they reach the joiner (the leaver's process is gone)
    assert stayer["after"]["all_reduce"] == stayer["after"]["world"] == after
    assert stayer["after"] == joiner["after"]
    assert stayer["after"]["dtensor"] == [VALUE[STAYER], VALUE[JOINER]]
    # DDP averages: the weight gradient sums the two inputs over 2 replicas
    assert stayer["after"]["ddp_grad"] == pytest.approx(after)
    assert stayer["before"]["ddp_grad"] == pytest.approx(before)
    # FSDP2 averages too: every entry of the 2x2 weight gradient is the mean input
    assert stayer["after"]["fsdp_grad"] == pytest.approx(2 * after)
    # the new generation's communicator carried them, counted with the group's own
    assert stayer["generation"] == 2
    assert stayer["accounting"]["generation"] == 1
    assert stayer["accounting"]["coll"] > 0 and stayer["accounting"]["pending"] == 0


def _dead_peer(rank, address, in_step):
    store = StoreClients(address).raw()
    role = LAYOUT.role_of(rank)
    _, groups, tg, sig = _torch_groups(address, role, 0)
    pg, model, mesh, fsdp = _holders(tg)
    _uses(pg, model, mesh, fsdp, 1.0)          # warm: both sides reached steady state
    if rank == 1:
        store.set("ready", "1")
        time.sleep(60)                          # killed by rank 0's order below
        return None
    store.wait(["ready"])
    os.kill(int(store.get("pid1").decode()), signal.SIGSTOP)   # a hung peer: nothing raises
    sig.in_step = in_step
    # the watcher would set the signal when the controller aborts the step: here a timer
    import threading

    threading.Timer(0.5, lambda: sig.set("step 7 aborted by the job")).start()
    t0 = time.monotonic()
    try:
        out = _uses(pg, model, mesh, fsdp, 1.0)
        result = ("returned", out)
    except RuntimeError as exc:
        result = ("raised", str(exc))
    elapsed = time.monotonic() - t0
    os.kill(int(store.get("pid1").decode()), signal.SIGKILL)
    return result, elapsed, sig.is_set(), tg.process_groups["dp"] is pg


def _dead_peer_entry(rank, address, in_step):
    if rank == 1:
        StoreClients(address).raw().set("pid1", str(os.getpid()))
    return _dead_peer(rank, address, in_step)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("in_step", [True, False], ids=["in-step", "outside-a-step"])
def test_a_hung_peer_never_blocks_torch_code_past_the_abort(in_step):
    res = run_processes(_dead_peer_entry, 2, in_step, timeout=90, expect=1)
    status, value = res[0]
    assert status == "ok", value
    (kind, detail), elapsed, signalled, same = value
    assert signalled and same
    # the group's timeout is 30 s: everything ended within a few seconds of the abort
    assert elapsed < 10, elapsed
    if in_step:
        # a doomed step: torch's code ran on to the end without an exception
        assert kind == "returned"
    else:
        assert kind == "raised" and "step 7 aborted by the job" in detail


MESH_LAYOUT = Layout(2, 1, 2)


def _mesh_switch(rank, address):
    """A 2-D ("dp", "tp") mesh and a DTensor sharded on both axes, made before dp0's tensor
    group moves to generation 1; after the switch the same mesh serves the new one."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from trainmover.comm.torch_groups import TorchGroups

    role = MESH_LAYOUT.role_of(rank)
    sig = AbortSignal()
    builder = GroupBuilder(StoreClients(address), torch.device("cpu"), 30.0, abort_signal=sig)
    groups, _ = build_comm_groups(builder, MESH_LAYOUT, role)
    tg = TorchGroups(groups, MESH_LAYOUT, role, sig, torch.device("cpu"))
    mesh = tg.device_mesh(("dp", "tp"))
    full = torch.arange(16.0).reshape(4, 4)
    x = distribute_tensor(full, mesh, [Shard(0), Shard(1)], src_data_rank=None)
    x.to_local().copy_(full[role.dp * 2:(role.dp + 1) * 2, role.tp * 2:(role.tp + 1) * 2])
    before = x.full_tensor()
    if role.dp == 0:
        spec = MESH_LAYOUT.tp_group(role)
        for old in groups.install({spec.name: builder.build(spec, role, 1)}):
            old.shutdown()
    after = x.redistribute(mesh, [Shard(0), Shard(0)]).full_tensor()
    return (before.tolist() == full.tolist(), after.tolist() == full.tolist(),
            mesh.mesh.tolist(), mesh.mesh_dim_names, tg.generation("tp"),
            groups.tp.accounting())


@pytest.mark.timeout(120)
def test_a_two_dimensional_device_mesh_follows_a_switch_of_one_of_its_groups():
    res = values(run_processes(_mesh_switch, 4, timeout=90))
    for rank, (before, after, mesh, names, generation, acct) in res.items():
        role = MESH_LAYOUT.role_of(rank)
        assert before and after
        assert names == ("dp", "tp") and mesh == [[0, 1], [2, 3]]
        if role.dp == 0:
            # re-pointed once more, and the new generation carried the ops after the switch
            assert generation == 2 and acct["generation"] == 1 and acct["coll"] > 0
        else:
            assert generation == 1 and acct["generation"] == 0


def _record_then_replay(rank, address):
    """Operations recorded on a real group, then answered from the recording by a sandbox
    (a standby's warm-up) on no network; then a replay that loses its place."""
    from trainmover.comm.record import sandbox_groups
    from trainmover.comm.torch_groups import TorchGroups

    cpu = torch.device("cpu")
    role = LAYOUT.role_of(rank)
    _, groups, tg, _ = _torch_groups(address, role, 0)

    def ops(pg):
        out = {}
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=pg)
        out["sum"] = t.item()
        # how a pipeline stage tells the next one its shapes: a pickled object
        objs = [{"shape": (4, 3)}] if rank == 0 else [None]
        if rank == 0:
            dist.send_object_list(objs, dst=1, group=pg)
        else:
            dist.recv_object_list(objs, src=0, group=pg)
        out["object"] = objs[0]
        big = torch.full((1024,), float(rank + 1))      # 4 KiB: over the limit below
        parts = [torch.zeros(1024) for _ in range(2)]
        dist.all_gather(parts, big, group=pg)
        out["big"] = [p[0].item() for p in parts]
        return out

    tg.start_recording(1024)
    real = ops(tg.process_groups["dp"])
    tape = tg.take_recording(keep_going=False)
    tg.close()
    groups.shutdown()
    sandbox = TorchGroups(sandbox_groups(LAYOUT, role, None, cpu), LAYOUT, role,
                          AbortSignal(), cpu, sandbox=True)
    pg = sandbox.process_groups["dp"]
    sandbox.load_replay(tape)
    replayed, clean = ops(pg), sandbox.mismatch()
    sandbox.load_replay(tape)
    t = torch.tensor([5.0, 5.0])       # the recording's first operation has one element
    dist.all_reduce(t, group=pg)
    diverged = sandbox.mismatch(), t.tolist()
    t = torch.tensor([7.0])            # the recording's second operation, had it kept its place
    dist.all_reduce(t, group=pg)
    after = t.item()
    sandbox.close()
    return real, replayed, clean, diverged, after


@pytest.mark.timeout(120)
def test_a_sandbox_answers_torch_operations_from_the_recording_of_the_real_ones():
    res = values(run_processes(_record_then_replay, 2, timeout=90))
    for rank, (real, replayed, clean, (why, diverged), after) in res.items():
        assert real == {"sum": 3.0, "object": {"shape": (4, 3)}, "big": [1.0, 2.0]}, rank
        # on no network: the real sum, the real object (the receiver's came from the
        # recording); the output over the limit was kept as its shape only: answered
        # locally (the own input, twice)
        assert replayed == {**real, "big": [rank + 1.0] * 2}, (rank, replayed)
        assert clean is None
        # an operation unlike the recorded one is answered locally and named; so is every
        # later one (the replay lost its place: a later entry would hand over wrong values)
        assert "ALLREDUCE" in why and "[2]" in why and "[1]" in why, why
        assert diverged == [5.0, 5.0] and after == 7.0


def _world_ops(rank, address, layout, switch, ckpt):
    """Every operation torch's default group offers, on a layout with two or more axes (the
    world composed from the axis groups); then, after a switch of one tensor group, again."""
    import torch.distributed.checkpoint as dcp
    from trainmover.comm.torch_groups import TorchGroups

    role = layout.role_of(rank)
    size = layout.num_roles
    sig = AbortSignal()
    builder = GroupBuilder(StoreClients(address), torch.device("cpu"), 30.0, abort_signal=sig)
    groups, _ = build_comm_groups(builder, layout, role)
    tg = TorchGroups(groups, layout, role, sig, torch.device("cpu"))
    out = {"rank": dist.get_rank(), "size": dist.get_world_size()}

    def ops(tag):
        got = {}
        t = torch.tensor([float(rank + 1), 1.0])
        dist.all_reduce(t)
        got["all_reduce"] = t.tolist()
        t = torch.tensor([rank])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        got["max"] = t.item()
        for root in (0, size - 1, 1):
            t = torch.tensor([rank * 1.5])
            dist.broadcast(t, src=root)
            got[f"broadcast{root}"] = t.item()
        parts = [torch.zeros(2) for _ in range(size)]
        dist.all_gather(parts, torch.tensor([rank, -rank], dtype=torch.float))
        got["all_gather"] = [p.tolist() for p in parts]
        flat = torch.zeros(size * 3, dtype=torch.int64)
        dist.all_gather_into_tensor(flat, torch.full((3,), rank))
        got["all_gather_into"] = flat.tolist()
        root = size - 2
        parts = [torch.zeros(1) for _ in range(size)] if rank == root else None
        dist.gather(torch.tensor([rank * 2.0]), parts, dst=root)
        got["gather"] = [p.item() for p in parts] if parts else None
        t = torch.zeros(2)
        blocks = [torch.tensor([r * 10.0, r]) for r in range(size)] if rank == 1 else None
        dist.scatter(t, blocks, src=1)
        got["scatter"] = t.tolist()
        t = torch.tensor([rank + 1.0])
        dist.reduce(t, dst=size - 1)
        got["reduce"] = t.item()
        t = torch.zeros(2)
        dist.reduce_scatter_tensor(t, torch.arange(size * 2, dtype=torch.float) * (rank + 1))
        got["reduce_scatter"] = t.tolist()
        dist.barrier()
        objs = [None] * size
        dist.all_gather_object(objs, {"r": rank, "tag": tag})
        got["all_gather_object"] = objs
        objs = [None] * size if rank == 0 else None
        dist.gather_object(f"w{rank}", objs, dst=0)
        got["gather_object"] = objs
        box = [f"from {size - 1}"] if rank == size - 1 else [None]
        dist.broadcast_object_list(box, src=size - 1)
        got["broadcast_object"] = box[0]
        box = [None]
        dist.scatter_object_list(box, [f"to {r}" for r in range(size)] if rank == 0 else None,
                                 src=0)
        got["scatter_object"] = box[0]
        # point-to-point with the tensor-parallel neighbour (one axis group apart)
        peer = layout.global_rank(Role(role.dp, role.pp, 1 - role.tp))
        t = torch.zeros(1)
        if role.tp == 0:
            dist.send(torch.tensor([rank + 100.0]), dst=peer)
            dist.recv(t, src=peer)
        else:
            dist.recv(t, src=peer)
            dist.send(torch.tensor([rank + 100.0]), dst=peer)
        got["p2p"] = t.item()
        return got

    out["before"] = ops("before")
    errors = []
    try:
        dist.all_to_all_single(torch.zeros(size), torch.zeros(size))
    except RuntimeError as exc:
        errors.append(str(exc))
    far = layout.global_rank(Role(1 - role.dp, role.pp, 1 - role.tp))
    try:
        dist.send(torch.zeros(1), dst=far)
    except RuntimeError as exc:
        errors.append(str(exc))
    out["errors"] = errors
    if switch and role.dp == 0:
        spec = layout.tp_group(role)
        for old in groups.install({spec.name: builder.build(spec, role, 1)}):
            old.shutdown()
        out["tp_generation"] = groups.tp.accounting()["generation"]
    out["after"] = ops("after")
    out["tp_coll"] = groups.tp.accounting()["coll"]
    # torch.distributed.checkpoint on the default group: a tensor sharded over every axis,
    # saved and loaded back into zeros
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = tg.device_mesh()
    full = torch.arange(float(size * 4)).reshape(size, 4)
    x = distribute_tensor(full, mesh, [Shard(0)] * 3, src_data_rank=None)
    x.to_local().copy_(full[rank:rank + 1])
    dcp.save({"x": x}, checkpoint_id=str(ckpt))
    y = distribute_tensor(torch.zeros(size, 4), mesh, [Shard(0)] * 3, src_data_rank=None)
    y.to_local().zero_()
    box = {"x": y}
    dcp.load(box, checkpoint_id=str(ckpt))
    out["dcp"] = box["x"].full_tensor().equal(full)
    return out


def _expected_world_ops(rank, size, tag):
    return {
        "all_reduce": [size * (size + 1) / 2, float(size)],
        "max": size - 1,
        **{f"broadcast{root}": root * 1.5 for root in (0, size - 1, 1)},
        "all_gather": [[r, -r] for r in range(size)],
        "all_gather_into": [r for r in range(size) for _ in range(3)],
        "gather": [r * 2.0 for r in range(size)] if rank == size - 2 else None,
        "scatter": [rank * 10.0, rank],
        "reduce": size * (size + 1) / 2 if rank == size - 1 else rank + 1.0,
        "reduce_scatter": [(2 * rank + i) * size * (size + 1) / 2 for i in range(2)],
        "all_gather_object": [{"r": r, "tag": tag} for r in range(size)],
        "gather_object": [f"w{r}" for r in range(size)] if rank == 0 else None,
        "broadcast_object": f"from {size - 1}",
        "scatter_object": f"to {rank}",
    }


@pytest.mark.timeout(150)
# the two-axis layout also saves and loads a DCP checkpoint on the world group
@pytest.mark.parametrize("layout", [Layout(2, 1, 2), Layout(2, 2, 2)], ids=["dp2tp2", "dp2pp2tp2"])
def test_the_world_group_of_a_multi_axis_layout_runs_every_operation_and_follows_a_switch(
        layout, tmp_path):
    size = layout.num_roles
    res = values(run_processes(_world_ops, size, layout, layout.pp == 1, tmp_path / "dcp",
                               timeout=120))
    for rank, out in res.items():
        role = layout.role_of(rank)
        assert (out["rank"], out["size"]) == (rank, size)
        peer = layout.global_rank(Role(role.dp, role.pp, 1 - role.tp))
        for tag in ("before", "after"):
            got = dict(out[tag])
            assert got.pop("p2p") == peer + 100.0
            assert got == _expected_world_ops(rank, size, tag), (rank, tag)
        # refused, naming what to use instead, before anything is sent
        assert len(out["errors"]) == 2
        assert "ALLTOALL_BASE on the world group is not supported" in out["errors"][0]
        assert "rt.groups.dp.process_group" in out["errors"][0]
        assert "share no axis group" in out["errors"][1]
        assert out["dcp"]
        if layout.pp == 1 and role.dp == 0:
            # the switched tensor group carried the world's operations after the switch
            assert out["tp_generation"] == 1 and out["tp_coll"] > 0
