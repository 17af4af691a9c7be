"""The state contract (TrainState) and the runtime's building blocks, with real processes
where communication is involved: transfer, checkpoint round trip, doomed steps, the
data-parallel wrapper."""
import math

import pytest
import torch
import torch.nn as nn

from mp_harness import run_processes, values
from trainmover.comm.groups import (AbortSignal, CommError, GroupBuilder, StepAborted,
                                    StoreClients, build_comm_groups)
from trainmover.core.topology import GroupSpec, Layout, Role
from trainmover.train import transfer
from trainmover.train.buckets import GradBuckets
from trainmover.train.ddp import DataParallel
from trainmover.train.state import StateError, TrainState, assemble
from trainmover.train.transfer import post_layout, recv_layout, recv_state, send_state


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(40, 30)
        self.b = nn.Linear(30, 2)
        self.register_buffer("seen", torch.zeros(3))

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def trained(seed: int, steps: int):
    torch.manual_seed(seed)
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(steps):
        net(torch.randn(4, 40)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    net.seen += steps
    return net, opt, sched


def same_state(a: TrainState, b: TrainState) -> bool:
    ta, _ = a.entries()
    tb, _ = b.entries()
    return sorted(ta) == sorted(tb) and all(torch.equal(ta[k], tb[k]) for k in ta)


def test_checkpoint_round_trip_restores_everything_into_a_fresh_model():
    net, opt, sched = trained(1, 5)
    src = TrainState(net, opt, extra={"sched": sched, "tokens": 1234,
                                      "ema": torch.arange(3.0)})
    tensors, dims = src.local_state()
    assert dims["model/a.weight"] is None and "optim/exp_avg/a.weight" in tensors
    assert "model/seen" in tensors          # buffers move too
    fresh_net, fresh_opt, fresh_sched = trained(2, 0)   # never stepped: no optimizer state
    extra = {"sched": fresh_sched, "tokens": 0, "ema": torch.zeros(3)}
    dst = TrainState(fresh_net, fresh_opt, extra=extra)
    assert not same_state(src, dst)
    dst.load({k: v.clone() for k, v in tensors.items()})
    assert same_state(src, dst)
    assert extra["tokens"] == 1234 and fresh_sched.last_epoch == sched.last_epoch
    assert fresh_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"] != 1e-2
    # the restored optimizer takes the same next step as the original
    x = torch.randn(4, 40)
    for n, o in ((net, opt), (fresh_net, fresh_opt)):
        n(x).pow(2).sum().backward()
        o.step()
    assert torch.equal(net.a.weight, fresh_net.a.weight)


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9)], ids=["adamw", "sgd-momentum"])
def test_a_rollback_to_a_state_from_before_the_first_step_leaves_the_optimizer_fresh(make_opt):
    """A survivor rolled back to the step-0 checkpoint (taken before any optimizer state
    existed) had state the checkpoint lacks: the load drops it, and the next steps are those
    of a run that never took the rolled-back steps (a CI run failed on 'state lacks 96
    entries' after a double failure rolled a job back to step 0)."""
    def run(steps_before_rollback):
        torch.manual_seed(3)
        net = Net()
        opt = make_opt(net.parameters())
        state = TrainState(net, opt)
        at_zero = {k: v.clone() for k, v in state.local_state()[0].items()}
        torch.manual_seed(9)
        for _ in range(steps_before_rollback):
            net(torch.randn(4, 40)).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        state.load(at_zero)
        assert not opt.state       # fresh again: the next step creates its state anew
        torch.manual_seed(9)
        for _ in range(2):
            net(torch.randn(4, 40)).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        return state

    assert same_state(run(3), run(0))


def test_a_compiled_model_has_the_state_names_of_the_eager_one():
    """torch.compile's wrapper holds the module as ``_orig_mod``: its checkpoints and
    transfers must match an eager run's by name (compiling is lazy: nothing compiles here)."""
    net, opt, _ = trained(1, 1)
    eager, _ = TrainState(net, opt).local_state()
    compiled, _ = TrainState(torch.compile(net), opt).local_state()
    assert sorted(compiled) == sorted(eager) and not any("_orig_mod" in k for k in compiled)


def test_loading_a_state_of_another_model_is_refused():
    net, opt, _ = trained(1, 1)
    tensors, _ = TrainState(net, opt).local_state()
    other = nn.Linear(40, 30)
    with pytest.raises(StateError):
        TrainState(other, torch.optim.AdamW(other.parameters())).load(tensors)


def test_assembly_refuses_a_name_held_by_two_stages():
    t = {"model/w": torch.ones(2)}
    shards = {Role(0, 0, 0): (t, {"model/w": None}), Role(0, 1, 0): (t, {"model/w": None})}
    with pytest.raises(StateError, match="held by pipeline stages 0 and 1"):
        assemble(shards, Layout(1, 2, 1))


def _transfer(rank, address, use_buckets, epoch_aborted=False, layout_first=False,
              in_place_min=None):
    if in_place_min is not None:
        # the large tensors' in-place path, with tensors this small: a.weight (4,800 bytes)
        # in place, the rest of the net packed in chunks of 512 bytes: many chunks through
        # the ring's two staging buffers, each reused
        transfer.IN_PLACE_MIN_BYTES = in_place_min
        transfer.STAGING_CHUNK_BYTES = 512
    signal = AbortSignal()
    builder = GroupBuilder(StoreClients(address), torch.device("cpu"), 30, abort_signal=signal)
    spec = GroupSpec("xfer.t", "xfer", (Role(0, 0, 0), Role(0, 0, 0)))
    channel = builder.build_ranked(spec, rank, 0, abortable=False)
    if epoch_aborted:
        # a failure elsewhere aborted the epoch after the handover: an abortable group
        # refuses to start, the migration's channel carries the state regardless
        abortable = builder.build_ranked(GroupSpec("xfer.u", "xfer", spec.members), rank, 0)
        signal.set("epoch 0 aborted: w3 crash")
        with pytest.raises(StepAborted):
            if rank == 0:
                abortable.send(torch.ones(1), 1)
            else:
                abortable.recv(torch.ones(1), 0)
        abortable.shutdown()
    net, opt, sched = trained(1 if rank == 0 else 2, 3 if rank == 0 else 0)
    groups = build_comm_groups(builder, Layout(), Role(0, 0, 0))[0]
    buckets = GradBuckets(list(net.parameters()), 4000, groups) if use_buckets else None
    # a registered tensor of another dtype, not contiguous on either side (a transpose), of
    # 15 bf16 values: packed with the fp32 entries, theirs start at an aligned offset after
    table = (torch.randn(5, 3) if rank == 0 else torch.zeros(5, 3)).to(torch.bfloat16).t()
    extra = {"sched": sched, "note": "leaver" if rank == 0 else "joiner", "table": table}
    state = TrainState(net, opt, extra=extra, buckets=buckets)
    torch.manual_seed(100 + rank)
    allocated = None
    if layout_first:
        # phase 1: the leaver posts its optimizer state's layout, the joiner allocates from it
        if rank == 0:
            posted = post_layout(state, channel, 1)
        else:
            fresh = {p: dict(st) for p, st in opt.state.items()}
            assert not any(fresh.values())       # the joiner's optimizer has not stepped
            allocated = recv_layout(state, channel, 0)["bytes"]
            entries = {k: (tuple(v.shape), v.dtype, float(v.abs().sum()))
                       for st in opt.state.values() for k, v in st.items()}
            assert entries and all(total == 0.0 for _, _, total in entries.values())
    if rank == 0:
        if layout_first:
            for work, _ in posted:
                work.wait()
            # after phase 1 (where each side took its state's view): a moment replaced by
            # another tensor (a new object: the view is taken again) and a parameter's data
            # replaced (the same object: the view reads it as it is now)
            st = opt.state[net.a.weight]
            st["exp_avg"] = st["exp_avg"] + 1.0
            net.b.weight.data = net.b.weight.data * 2.0
        info = send_state(state, channel, 1, resume_step=17)
        out = None
    else:
        out, info = recv_state(state, channel, 0)
    assert state._view is None      # released by the transfer: it holds the state's tensors
    tensors, _ = state.entries()
    # plain lists: tensors sent through the result queue would outlive their process
    digest = {k: v.reshape(-1).tolist() for k, v in tensors.items()}
    assert extra["table"] is table and not table.is_contiguous()   # received in place
    return (out, info["bytes"], digest, extra["note"], torch.randint(0, 10**9, (1,)).item(),
            allocated)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("use_buckets,epoch_aborted,layout_first,in_place_min",
                         [(True, False, False, None), (False, False, False, None),
                          (True, True, False, None), (True, False, True, None),
                          (True, False, False, 4000)],
                         ids=["buckets", "plain", "after-an-epoch-abort", "layout-in-phase-1",
                              "large-in-place-small-in-many-chunks"])
def test_live_transfer_moves_the_whole_state(use_buckets, epoch_aborted, layout_first,
                                             in_place_min):
    res = values(run_processes(_transfer, 2, use_buckets, epoch_aborted, layout_first,
                               in_place_min))
    (_, sent, a, _, rng_a, _), (resume, got, b, note, rng_b, allocated) = res[0], res[1]
    if layout_first:
        # the joiner's moments were allocated before the transfer (the leaver had stepped)
        assert allocated > 0
    else:
        assert allocated is None
    assert resume == 17 and sent == got > 0
    assert sorted(a) == sorted(b) and all(a[k] == b[k] for k in a)
    assert note == "leaver"     # JSON extras are replaced in the registered dict
    assert rng_a == rng_b       # the joiner continues the leaver's random stream


def test_the_transfer_view_is_kept_while_the_state_holds_the_same_tensors():
    net, opt, sched = trained(1, 2)
    extra = {"table": torch.ones(3), "note": "a"}
    state = TrainState(net, opt, extra=extra)
    view = state.transfer_view()
    assert sorted(view.tensors) == sorted(state.tensors())
    assert view.layout == state._optim_layout()
    opt.step()                  # in place: the same tensors
    extra["note"] = "b"         # not a tensor
    net.a.weight.data = net.a.weight.data.clone()   # the same parameter, other storage
    assert state.transfer_view() is view and view.tensors["model/a.weight"] is net.a.weight
    # each change makes the view be taken again: a moment replaced, a registered tensor
    # replaced, a parameter replaced, a parameter's data of another shape, an optimizer
    # entry dropped
    moments = opt.state[net.b.bias]
    for change in (lambda: moments.__setitem__("exp_avg", torch.zeros(2)),
                   lambda: extra.__setitem__("table", torch.ones(3)),
                   lambda: setattr(net.b, "bias", nn.Parameter(torch.zeros(2))),
                   lambda: setattr(net.b.weight, "data", torch.zeros(2, 31)),
                   lambda: opt.state.pop(net.a.bias)):
        change()
        again = state.transfer_view()
        assert again is not view
        view = again
    assert view.tensors["extra/table"] is extra["table"]
    assert view.tensors["model/b.bias"] is net.b.bias
    assert view.tensors["optim/exp_avg/b.bias"] is moments["exp_avg"]
    assert view.layout["b.weight"]["exp_avg"][0] == [2, 30]   # its moments, not its data
    assert view.tensors["model/b.weight"].shape == (2, 31)
    assert "a.bias" not in view.layout and "optim/exp_avg/a.bias" not in view.tensors
    # entries dropped here (a rollback to a fresh optimizer's checkpoint): the view, which
    # holds the dropped tensors, is released at once
    assert state._match_optim({}) and state._view is None


def _doomed(rank, address):
    signal = AbortSignal()
    builder = GroupBuilder(StoreClients(address), torch.device("cpu"), 30, abort_signal=signal)
    layout = Layout(2, 1, 1)
    groups, _ = build_comm_groups(builder, layout, layout.role_of(rank))
    t = torch.ones(3)
    groups.dp.allreduce(t)
    out = {"first": t.tolist()}
    signal.set("test abort")
    signal.in_step = True              # inside a step: the op returns, the step is doomed
    t = torch.full((3,), 5.0)
    groups.dp.allreduce(t)
    out["doomed"] = t.tolist()
    signal.in_step = False             # outside a step: the same abort raises
    try:
        groups.dp.allreduce(t)
        out["outside"] = "returned"
    except StepAborted:
        out["outside"] = "raised"
    out["accounting"] = groups.dp.accounting()
    return out


@pytest.mark.timeout(120)
def test_a_doomed_step_returns_without_communicating_and_raises_outside_a_step():
    res = values(run_processes(_doomed, 2))
    for out in res.values():
        assert out["first"] == [2.0, 2.0, 2.0]
        assert out["doomed"] == [5.0, 5.0, 5.0]      # untouched: nothing was issued
        assert out["outside"] == "raised"
        assert out["accounting"]["coll"] == 1 and out["accounting"]["pending"] == 0


def test_doom_records_the_first_reason_only_in_a_step():
    s = AbortSignal()
    assert not s.doom(CommError("g", 0, "allreduce", "peer gone"))
    assert not s.is_set()
    s.in_step = True
    assert s.doom(CommError("g", 0, "allreduce", "peer gone"))
    s.doom(StepAborted("later"))
    assert s.is_set() and "peer gone" in s.reason


def _ddp(rank, address):
    layout = Layout(2, 1, 1)
    builder = GroupBuilder(StoreClients(address), torch.device("cpu"), 30)
    groups, _ = build_comm_groups(builder, layout, layout.role_of(rank))
    torch.manual_seed(0)
    net = Net()
    model = DataParallel(net, groups, bucket_mb=0.001)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    for step in range(3):
        xs = torch.randn(2, 4, 40, generator=gen)
        with model.no_sync():            # accumulate the first micro-batch locally
            model(xs[0]).pow(2).mean().backward()
        model(xs[1]).pow(2).mean().backward()
        grads = [p.grad.clone() for p in net.parameters()]
        opt.step()
        opt.zero_grad(set_to_none=True)  # the wrapper points grads back into its buckets
    return [g.tolist() for g in grads], \
        {n: p.detach().reshape(-1).tolist() for n, p in net.named_parameters()}, \
        model.canonical_name("module.a.weight")


def _reference_grads():
    """The same two replicas' accumulated gradients averaged by hand, in one process."""
    torch.manual_seed(0)
    nets = [Net(), Net()]
    nets[1].load_state_dict(nets[0].state_dict())
    opts = [torch.optim.SGD(n.parameters(), lr=0.1) for n in nets]
    gens = [torch.Generator().manual_seed(r) for r in range(2)]
    for step in range(3):
        for r in range(2):
            xs = torch.randn(2, 4, 40, generator=gens[r])
            for x in xs:
                nets[r](x).pow(2).mean().backward()
        avg = [(a.grad + b.grad) / 2 for a, b in zip(nets[0].parameters(), nets[1].parameters())]
        for n, o in zip(nets, opts):
            for p, g in zip(n.parameters(), avg):
                p.grad = g.clone()
            o.step()
            o.zero_grad()
    return avg


@pytest.mark.timeout(120)
def test_data_parallel_wrapper_averages_accumulated_gradients_like_ddp():
    res = values(run_processes(_ddp, 2))
    (g0, p0, name), (g1, p1, _) = res[0], res[1]
    ref = _reference_grads()
    for a, b, r in zip(g0, g1, ref):
        assert a == b
        torch.testing.assert_close(torch.tensor(a), r, rtol=1e-5, atol=1e-7)
    assert p0 == p1
    assert name == "a.weight"
    assert all(math.isfinite(sum(v)) for v in p0.values())


def test_the_canonical_state_of_dp_sharded_roles_concatenates_their_shares():
    """FSDP2 over the dp axis (Layout.dp_sharded): each dp role holds rows of a parameter; the
    canonical tensor is their concatenation in dp order, uneven and empty shares included,
    and entries without a dp dimension come from dp rank 0."""
    full = torch.arange(10.0).reshape(5, 2)
    shares = [full[0:3], full[3:5], full[5:5]]        # torch.chunk's split of 5 rows over 3
    step = torch.tensor(7.0)
    shards = {Role(dp, 0, 0): ({"model/w": shares[dp], "optim/step/w": step},
                               {"model/w": None, "optim/step/w": None}, {"model/w": 0})
              for dp in range(3)}
    canon = assemble(shards, Layout(3, 1, 1, dp_sharded=True))
    assert torch.equal(canon["model/w"], full) and torch.equal(canon["optim/step/w"], step)
    # the same shares as replicas: dp rank 0's alone
    replicas = assemble(shards, Layout(3, 1, 1))
    assert torch.equal(replicas["model/w"], shares[0])


def test_dtensor_shares_are_placed_by_their_boxes_whatever_the_nesting_of_shardings():
    """FSDP2 inside tensor parallelism (the 2-D example): tp splits the rows in two, and dp
    splits each tp half again (a strided shard), so dp-then-tp concatenation would be wrong;
    each share's box (global shape, offset) places it. A share missing is an error."""
    full = torch.arange(16.0).reshape(8, 2)
    offset = {(0, 0): 0, (1, 0): 2, (0, 1): 4, (1, 1): 6}      # (dp, tp) -> first row

    def shard(dp, tp):
        o = offset[(dp, tp)]
        return ({"model/w": full[o:o + 2].clone()}, {"model/w": 0}, {"model/w": 0},
                {"model/w": ([8, 2], [o, 0])})

    shards = {Role(dp, 0, tp): shard(dp, tp) for dp in range(2) for tp in range(2)}
    canon = assemble(shards, Layout(2, 1, 2, dp_sharded=True))
    assert torch.equal(canon["model/w"], full)
    # two roles claiming the same rows leave others uncovered
    shards[Role(1, 0, 1)] = shard(0, 1)
    with pytest.raises(StateError, match="cover 12 of its 16 elements"):
        assemble(shards, Layout(2, 1, 2, dp_sharded=True))


def test_a_sharded_dp_layout_has_no_replicas_and_every_role_holds_a_final_share():
    sharded, replicated = Layout(2, 2, 1, dp_sharded=True), Layout(2, 2, 1)
    assert not sharded.has_replicas and replicated.has_replicas
    assert all(sharded.holds_final_share(r) for r in sharded.roles())
    assert [r.dp for r in replicated.roles() if replicated.holds_final_share(r)] == [0, 0]
    assert sharded.as_dict() == {"dp": 2, "pp": 2, "tp": 1, "dp_sharded": True}
    assert replicated.as_dict() == {"dp": 2, "pp": 2, "tp": 1}
    with pytest.raises(ValueError, match="dp_sharded"):
        Layout(2, 1, 1, dp_sharded="yes")


# --- pre-copy with catch-up (train/precopy.py) -----------------------------------------------

def _optimizer(kind: str, params):
    if kind == "sgd-momentum":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3)
    if kind == "adamw-fused":
        return torch.optim.AdamW(params, lr=1e-2, fused=True)
    # "adamw": torch's default implementation for the device (foreach on CUDA)
    return torch.optim.AdamW(params, lr=1e-2, foreach=True if kind == "adamw-foreach" else None)


def _precopy_pair(rank, address, kind, use_buckets, warm_steps, give_up_at, device="cpu",
                  edit_outside=False):
    """A leaver trains ``warm_steps`` steps, then pre-copies while it trains 6 more (chunks
    of one parameter per boundary: the last ones are sent mid-way); the joiner replays.
    ``give_up_at``: the step at which the leaver gives the pre-copy up (None: never).
    ``edit_outside``: the leaver's script changes a parameter outside the optimizer."""
    from trainmover.train.precopy import PrecopyReceiver, PrecopySender, checksums

    device = torch.device(device)
    # gloo (staged through host memory on CUDA: NCCL refuses two ranks on one GPU)
    builder = GroupBuilder(StoreClients(address), device, 30, abort_signal=AbortSignal(),
                           backend="gloo")
    spec = GroupSpec("xfer.p", "xfer", (Role(0, 0, 0), Role(0, 0, 0)))
    channel = builder.build_ranked(spec, rank, 0, abortable=False)
    torch.manual_seed(1 if rank == 0 else 2)       # the joiner starts from other weights
    net = Net().to(device)
    opt = _optimizer(kind, net.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    groups = build_comm_groups(builder, Layout(), Role(0, 0, 0))[0]
    buckets = GradBuckets(list(net.parameters()), 4000, groups) if use_buckets else None
    state = TrainState(net, opt, extra={"sched": sched}, buckets=buckets)

    def train_step():
        opt.zero_grad(set_to_none=buckets is None)
        if buckets is not None:
            buckets.restore_views()
        net(torch.randn(4, 40).to(device)).pow(2).sum().backward()
        opt.step()
        sched.step()
        if edit_outside:
            with torch.no_grad():
                net.b.bias.clamp_(-0.01, 0.01)     # what no replay of the optimizer repeats

    if rank == 0:
        for _ in range(warm_steps):
            train_step()
        posted = post_layout(state, channel, 1, precopy=True)
        sender = PrecopySender(state, channel, 1, chunk_bytes=1, max_wait=1e9)
        step = [warm_steps]
        opt.register_step_pre_hook(
            lambda o, args, kwargs: sender.before_optimizer(step[0], args, kwargs))
        for step[0] in range(warm_steps, warm_steps + 6):
            if step[0] == give_up_at:
                sender._give_up("test")
            sender.at_boundary(step[0])
            train_step()
        net.seen += 1                                 # a buffer: not kept by the replay
        for work, _ in posted:
            work.wait()
        held = sender.finish()
        info = send_state(state, channel, 1, resume_step=step[0] + 1, skip_params=held)
        from trainmover.train.state import _rng_states
        rng = sum(v.numel() for v in _rng_states().values())    # the CPU's (and CUDA's)
        extra = (sorted(held), sender.steps, sender.failed, rng)
    else:
        precopy = recv_layout(state, channel, 0)["precopy"]
        receiver = PrecopyReceiver(state, channel, 0)
        held = receiver.run()
        _, info = recv_state(state, channel, 0, skip_params=held)
        extra = (sorted(held), receiver.steps, precopy)
    tensors, _ = state.entries()
    digest = {k: v.reshape(-1).tolist() for k, v in tensors.items()}
    return digest, info["bytes"], extra + (checksums(state, held),), opt.param_groups[0]["lr"]


def check_precopy_pair(res: dict, give_up_at) -> None:
    (a, sent, (held_a, steps_a, why, rng, sums_a), lr_a), \
        (b, got, (held_b, steps_b, said, sums_b), lr_b) = res[0], res[1]
    assert sums_a == sums_b and (len(sums_a) > len(held_a) if held_a else not sums_a)
    assert said is True and held_a == held_b and steps_a == steps_b
    assert sorted(a) == sorted(b)
    assert [k for k in a if a[k] != b[k]] == []
    assert lr_a == lr_b and sent == got
    if give_up_at is None:
        # every parameter was sent before the switch (one per boundary, 4 of them), and
        # replayed for each step after its own chunk: the switch moved no parameter or moment
        assert why is None
        assert held_a == ["a.bias", "a.weight", "b.bias", "b.weight"] and steps_a == 6
        # at the switch: the generators' states and the buffer (3 floats), nothing else
        assert sent == rng + 3 * 4
    else:
        assert held_a == [] and sent > 40 * 30 * 4 * 3    # the whole state at the switch


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind,use_buckets,warm_steps,give_up_at",
                         [("adamw", True, 2, None), ("adamw-foreach", False, 2, None),
                          ("sgd-momentum", True, 0, None), ("adamw", False, 0, None),
                          ("adamw", True, 2, 5)],
                         ids=["adamw-buckets", "adamw-foreach", "sgd-momentum-fresh",
                              "adamw-fresh", "given-up"])
def test_a_precopied_state_replayed_by_the_joiner_is_bit_identical(kind, use_buckets,
                                                                    warm_steps, give_up_at):
    res = values(run_processes(_precopy_pair, 2, kind, use_buckets, warm_steps, give_up_at))
    check_precopy_pair(res, give_up_at)


@pytest.mark.timeout(120)
def test_a_script_that_changes_a_parameter_outside_the_optimizer_is_caught_by_the_checksums():
    from trainmover.train.precopy import first_difference

    res = values(run_processes(_precopy_pair, 2, "adamw", True, 2, None, "cpu", True))
    (a, _, (held, _, why, _, sums_a), _), (b, _, (_, _, _, sums_b), _) = res[0], res[1]
    assert why is None and held            # the pre-copy itself went through
    assert a["model/b.bias"] != b["model/b.bias"]      # the replay could not follow the edit
    assert first_difference(sums_a, sums_b) == "model/b.bias"


def _striped(rank, address, use_buckets):
    """Ranks 0 and 1: replicas of one role (the same training), each sending its share of
    the state; rank 2: the joiner, receiving both shares at once."""
    from trainmover.train.transfer import recv_striped

    builder = GroupBuilder(StoreClients(address), torch.device("cpu"), 30,
                           abort_signal=AbortSignal())
    role = Role(0, 0, 0)
    if rank < 2:
        channels = [builder.build_ranked(GroupSpec(f"rx.{rank}", "xfer", (role, role)), 0, 0,
                                         abortable=False)]
    else:
        channels = [builder.build_ranked(GroupSpec(f"rx.{i}", "xfer", (role, role)), 1, 0,
                                         abortable=False) for i in range(2)]
    net, opt, sched = trained(1 if rank < 2 else 2, 3 if rank < 2 else 0)
    groups = build_comm_groups(builder, Layout(), role)[0]
    buckets = GradBuckets(list(net.parameters()), 4000, groups) if use_buckets else None
    state = TrainState(net, opt, extra={"sched": sched}, buckets=buckets)
    torch.manual_seed(7)
    if rank < 2:
        info = send_state(state, channels[0], 1, resume_step=9, part=(rank, 2))
        out = None
    else:
        out, info = recv_striped(state, channels, 0)
    tensors, _ = state.entries()
    return (out, info["bytes"], {k: v.reshape(-1).tolist() for k, v in tensors.items()},
            torch.randint(0, 10**9, (1,)).item())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("use_buckets", [True, False], ids=["buckets", "plain"])
def test_a_striped_recovery_takes_a_share_from_each_replica(use_buckets):
    res = values(run_processes(_striped, 3, use_buckets))
    (_, sent0, a, rng0), (_, sent1, a1, _), (step, got, b, rng_b) = res[0], res[1], res[2]
    assert step == 9 and a == a1
    assert sorted(a) == sorted(b) and [k for k in a if a[k] != b[k]] == []
    assert rng_b == rng0                   # the generators' states came with share 0
    assert sent0 > 0 and sent1 > 0 and sent0 + sent1 == got
