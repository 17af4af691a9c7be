"""The state's wire transfer: a leaver (or a replica) sends a ``TrainState`` to a joiner over
a point-to-point group, for a planned migration and a recovery from a replica.

The sender needs no extra memory for parameters and moments: a large tensor (from
``IN_PLACE_MIN_BYTES``) travels in place, smaller ones packed through the gradient buckets
when there are any (the gradients are zero at a step boundary). Entries travel in flight
together within ``TRANSFER_WINDOW_BYTES``, so the link does not wait for a round trip per
entry and packing overlaps sending. Small entries (and the generators' states) travel
packed in one message. A striped recovery (``recv_striped``) takes a share of the entries
from each of several replicas at once, one channel each.
"""
from __future__ import annotations

import threading
import time
from collections import deque

import torch

from trainmover.train.state import (_SMALL, TrainState, _as_bytes, _from_json_tensor,
                                    _json_tensor, _rng_states, _set_rng_states,
                                    canonical_params)


# The layout message's tags, apart from the state's (0, 1, then one per entry from 2).
LAYOUT_TAG = 1 << 20


def post_layout(state: TrainState, group, peer: int, precopy: bool = False) -> list:
    """Leaver, in phase 1 (at a step boundary): the layout of its optimizer state (per
    parameter, each entry's shape and dtype), sent without waiting: [(work, tensor)], the
    works waited for at the switch. The joiner allocates the moments it lacks before the
    switch instead of inside it.

    Why: a joiner's optimizer is fresh (torch optimizers create their state at the first
    step), so allocating it at the switch put the first touch of every page of it (AdamW:
    two moments, two thirds of the state) on the critical path. Where those pages were cold
    that was 1.7 of the 2.2 s a 390 MB state's transfer took (py-spy, one run); where the
    host had backed them already, no measurable difference (three runs each way).

    ``precopy``: the state is pre-copied from now on (``train/precopy.py``), which the
    joiner learns here, before anything of it arrives."""
    blob = _json_tensor({"optim_state": state._optim_layout(),
                         "precopy": precopy}).to(group.device)
    head = torch.tensor([blob.numel()], dtype=torch.int64, device=group.device)
    # each tensor kept with its work: alive until the send completes
    return [(group.send(head, peer, tag=LAYOUT_TAG), head),
            (group.send(blob, peer, tag=LAYOUT_TAG + 1), blob)]


def recv_layout(state: TrainState, group, peer: int) -> dict:
    """Joiner, in phase 1: allocate (zeroed: every page touched now) the optimizer state
    entries of the leaver's layout that this optimizer lacks. Returns the bytes allocated,
    the seconds taken and whether the leaver pre-copies its state."""
    t0 = time.perf_counter()
    layout = recv_json(group, peer, LAYOUT_TAG)
    before = _optim_bytes(state)
    state._match_optim(layout["optim_state"])
    return {"bytes": _optim_bytes(state) - before, "seconds": time.perf_counter() - t0,
            "precopy": bool(layout.get("precopy"))}


def _optim_bytes(state: TrainState) -> int:
    if state.optimizer is None:
        return 0
    return sum(v.numel() * v.element_size() for st in state.optimizer.state.values()
               for v in st.values() if isinstance(v, torch.Tensor))


def send_state(state: TrainState, group, peer: int, resume_step: int,
               skip_params: frozenset[str] = frozenset(), part: tuple[int, int] = (0, 1)
               ) -> dict:
    """Leaver (or replica) side: the whole state and the step to resume at. Large tensors
    are sent in place; smaller parameters and moments go packed through the gradient
    buckets when there are any (at an iteration boundary the gradients are zero: the
    buckets are zeroed again after use), so the sender needs no extra memory. The
    smallest entries travel packed in one message. ``skip_params``: parameters the joiner
    already holds current (pre-copied): neither they nor their optimizer state travel.
    ``part``: (i, k) of a striped recovery: this sender's share (``_share``) only, each
    share as its own message set (no bucket staging: the joiner receives every share at
    once), the generators' states with share 0."""
    t0 = time.perf_counter()
    i, k = part
    meta = state.meta()
    meta["resume_step"] = resume_step
    rng = _rng_states() if i == 0 else {}
    meta["rng"] = {name: v.numel() for name, v in rng.items()}
    blob = _json_tensor(meta).to(group.device)
    head = torch.tensor([blob.numel()], dtype=torch.int64, device=group.device)
    group.send(head, peer, tag=0).wait()
    group.send(blob, peer, tag=1).wait()
    tensors = _unskipped(state, skip_params)
    if k > 1:
        tensors = _share(tensors, i, k)
    nbytes = _move(state, group, peer, tensors, rng, sending=True, staged=k == 1)
    return {"bytes": nbytes, "seconds": time.perf_counter() - t0}


def _share(tensors: dict[str, torch.Tensor], i: int, k: int) -> dict[str, torch.Tensor]:
    """Share ``i`` of ``k`` of the entries: those whose first byte, in name order, falls in
    the i-th k-th of their bytes (whole entries, so shares are near equal for a model of
    many tensors). Every sender and the joiner decide alike from names and sizes."""
    sizes = {n: t.numel() * t.element_size() for n, t in tensors.items()}
    total, at, out = sum(sizes.values()), 0, {}
    for name in sorted(tensors):
        if (at * k // total if total else 0) == i:
            out[name] = tensors[name]
        at += sizes[name]
    return out


def recv_striped(state: TrainState, groups: list, peer: int) -> tuple[int, dict]:
    """Joiner side of a striped recovery: a share of the state from each of ``groups``
    (share i from the i-th sender), all at once, each on its own thread. The metadata is
    share 0's (every sender's is the same state's)."""
    t0 = time.perf_counter()
    metas = [recv_json(g, peer) for g in groups]
    steps = {m["resume_step"] for m in metas}
    if len(steps) != 1:
        raise RuntimeError(f"striped recovery: the replicas sent the states of steps "
                           f"{sorted(steps)}")
    state._apply_meta(metas[0])
    rng = {name: torch.zeros(n, dtype=torch.uint8) for name, n in metas[0]["rng"].items()}
    tensors = _unskipped(state, frozenset())
    k = len(groups)
    counts, errors = [0] * k, []

    def receive(i: int) -> None:
        try:
            counts[i] = _move(state, groups[i], peer, _share(tensors, i, k),
                              rng if i == 0 else {}, sending=False, staged=False)
        except BaseException as exc:  # noqa: BLE001 - raised below, on the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=receive, args=(i,), daemon=True,
                                name=f"recv-share-{i}") for i in range(k)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    _set_rng_states(rng)
    return int(metas[0]["resume_step"]), {"bytes": sum(counts), "shares": counts,
                                          "seconds": time.perf_counter() - t0}


def recv_json(group, peer: int, tag: int = 0) -> dict:
    """A JSON value sent as its length (on ``tag``) and its bytes (on ``tag + 1``)."""
    head = torch.zeros(1, dtype=torch.int64, device=group.device)
    group.recv(head, peer, tag=tag).wait()
    blob = torch.zeros(int(head.item()), dtype=torch.uint8, device=group.device)
    group.recv(blob, peer, tag=tag + 1).wait()
    return _from_json_tensor(blob)


def recv_state(state: TrainState, group, peer: int,
               skip_params: frozenset[str] = frozenset()) -> tuple[int, dict]:
    """Joiner side: overwrites the whole state (but the ``skip_params``, as the sender's).
    Returns the step to resume at."""
    t0 = time.perf_counter()
    meta = recv_json(group, peer)
    state._apply_meta(meta)
    rng = {k: torch.zeros(n, dtype=torch.uint8) for k, n in meta["rng"].items()}
    tensors = _unskipped(state, skip_params)
    nbytes = _move(state, group, peer, tensors, rng, sending=False)
    _set_rng_states(rng)
    return int(meta["resume_step"]), {"bytes": nbytes, "seconds": time.perf_counter() - t0}


def _unskipped(state: TrainState, skip_params: frozenset[str]) -> dict[str, torch.Tensor]:
    """The entries that travel: all but a skipped parameter's own and its optimizer state's
    (``optim/<key>/<param>``). Both sides decide alike from names alone (the receiver's
    optimizer entries were made the sender's by the metadata first)."""
    tensors, _ = state.entries()
    if not skip_params:
        return tensors
    return {n: t for n, t in tensors.items() if not skipped(n, skip_params)}


def skipped(name: str, skip_params: frozenset[str]) -> bool:
    """Whether entry ``name`` is a skipped parameter's own or its optimizer state's."""
    return (name.startswith("model/") and name[len("model/"):] in skip_params) or \
        (name.startswith("optim/") and name.split("/", 2)[2] in skip_params)


def _move(state: TrainState, group, peer: int, tensors: dict[str, torch.Tensor],
          rng: dict[str, torch.Tensor], sending: bool, staged: bool = True) -> int:
    """Both sides walk the same entries in the same order (names sorted; the receiver
    allocated what it lacked from the sender's layout first), each entry with its own
    tag, several in flight at once (``_pipelined``): packing the next bucket overlaps
    sending the last, and the link never waits for a round trip between entries.
    ``staged``: small entries may be packed through the gradient buckets (not when several
    transfers run at once on one process: they would share the buffers)."""
    tag, nbytes = 2, 0
    by_param = {id(p): n for n, p in canonical_params(state.model)} \
        if state.model is not None else {}
    bucketed: set[str] = set()
    with torch.no_grad():
        if state.buckets is not None and staged:
            # kinds of per-parameter tensors: the parameter itself and each moment
            kinds = ["model"] + sorted({k.split("/")[1] for k in tensors
                                        if k.startswith("optim/")})
            for kind in kinds:
                # each bucket has its own buffer: a kind's buckets travel together, and
                # the next kind reuses the buffers once they are done. Only a bucket's small
                # tensors are packed (at the front of its buffer); large ones travel in
                # place (below), with no copy on either side: packing and unpacking them
                # took about 40% of the transfer's time on a CPU (benchmarks/transfer_pair.py)
                items = []
                for buf, parts in _bucket_parts(state, kind, tensors, by_param):
                    small = [(n, t) for n, t in parts or () if not _large(t)]
                    if small:
                        used = sum(t.numel() for _, t in small)
                        items.append((used * buf.element_size(), buf[:used], small))
                tags = range(tag, tag + len(items))
                tag += len(items)
                _pipelined(list(zip(tags, items)), group, peer, sending,
                           pack=_pack_bucket, unpack=_unpack_bucket)
                for size, _, parts in items:
                    nbytes += size
                    bucketed.update(name for name, _ in parts)
        small = [(n, t) for n, t in tensors.items()
                 if n not in bucketed and t.numel() < _SMALL] + sorted(rng.items())
        # a tensor travels on the group's device (NCCL takes no CPU tensor; a user's
        # extra state may live on the CPU), in place where it can
        large = [(t.numel() * t.element_size(), t, None) for n, t in tensors.items()
                 if n not in bucketed and t.numel() >= _SMALL]
        _pipelined(list(zip(range(tag, tag + len(large)), large)), group, peer, sending,
                   pack=_pack_tensor, unpack=_unpack_tensor)
        tag += len(large)
        nbytes += sum(size for size, _, _ in large)
        if small:
            sizes = [t.numel() * t.element_size() for _, t in small]
            packed = torch.empty(sum(sizes), dtype=torch.uint8, device=group.device)
            if sending:
                offset = 0
                for (_, t), n in zip(small, sizes):
                    packed[offset:offset + n].copy_(_as_bytes(t).to(group.device))
                    offset += n
                group.send(packed, peer, tag=tag).wait()
            else:
                group.recv(packed, peer, tag=tag).wait()
                offset = 0
                for (_, t), n in zip(small, sizes):
                    _as_bytes(t).copy_(packed[offset:offset + n])
                    offset += n
            nbytes += packed.numel()
        if state.buckets is not None:
            for buf in state.buckets.buffers:
                # the gradients are zero at a step boundary (the step that follows
                # accumulates into them, with or without a zero_grad that sets them to
                # None); last, off the wire's way: the buffers staged small entries
                buf.zero_()
    return nbytes


# From this size an entry travels as its own message rather than packed with others: the
# per-message cost (tens of microseconds) is then a few percent of its time on the link.
IN_PLACE_MIN_BYTES = 1 << 20


def _large(t: torch.Tensor) -> bool:
    """Decided by size alone, so both sides decide alike whatever their tensors' strides."""
    return t.numel() * t.element_size() >= IN_PLACE_MIN_BYTES


def _bucket_parts(state: TrainState, kind: str, tensors: dict[str, torch.Tensor],
                  by_param: dict):
    """Per gradient bucket: the buffer and the (name, tensor) of ``kind`` of each of its
    parameters, in bucket order; None where some parameter has no such tensor."""
    for bucket, buf in zip(state.buckets.buckets, state.buckets.buffers):
        parts = []
        for p in bucket:
            pname = by_param.get(id(p))
            name = f"model/{pname}" if kind == "model" else f"optim/{kind}/{pname}"
            t = tensors.get(name)
            if pname is None or t is None or t.numel() != p.numel() or t.dtype != buf.dtype:
                parts = None
                break
            parts.append((name, t))
        yield buf, parts


# How many bytes of a state transfer may be in flight at once: enough to keep the link busy
# while the next entry is packed (a few gradient buckets), and a bound on the staging
# memory a transfer may add (a GPU tensor over gloo is copied to the host while in flight).
TRANSFER_WINDOW_BYTES = 64 << 20


def _pipelined(items: list, group, peer: int, sending: bool, pack, unpack) -> None:
    """Send (or receive) ``items`` = [(tag, (nbytes, tensor, parts))] in order, several in
    flight: at most ``TRANSFER_WINDOW_BYTES`` (always at least one), the oldest finished
    first. ``pack(tensor, parts, device)`` gives what to send; ``unpack(tensor, parts,
    received)`` puts a received one in place, given what ``pack``'s receive twin gave."""
    flight: deque = deque()
    held = 0

    def finish_oldest() -> None:
        nonlocal held
        work, size, tensor, parts, wire = flight.popleft()
        work.wait()
        if not sending:
            unpack(tensor, parts, wire)
        held -= size

    for tag, (size, tensor, parts) in items:
        while flight and held + size > TRANSFER_WINDOW_BYTES:
            finish_oldest()
        if sending:
            wire = pack(tensor, parts, group.device)
            work = group.send(wire, peer, tag=tag)
        else:
            wire = _receive_buffer(tensor, parts, group.device)
            work = group.recv(wire, peer, tag=tag)
        flight.append((work, size, tensor, parts, wire))
        held += size
    while flight:
        finish_oldest()


def _receive_buffer(tensor: torch.Tensor, parts, device) -> torch.Tensor:
    """Where an entry is received: a bucket's own buffer, or the tensor itself when it is
    contiguous on the group's device, else a staging tensor."""
    if parts is not None or (tensor.is_contiguous() and tensor.device == device):
        return tensor
    return torch.empty(tensor.shape, dtype=tensor.dtype, device=device)


def _pack_bucket(buf: torch.Tensor, parts, device) -> torch.Tensor:
    offset = 0
    for _, t in parts:
        buf[offset:offset + t.numel()].copy_(t.reshape(-1))
        offset += t.numel()
    return buf


def _unpack_bucket(buf: torch.Tensor, parts, received: torch.Tensor) -> None:
    offset = 0
    for _, t in parts:
        t.copy_(buf[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def _pack_tensor(t: torch.Tensor, parts, device) -> torch.Tensor:
    return t.contiguous().to(device)


def _unpack_tensor(t: torch.Tensor, parts, received: torch.Tensor) -> None:
    if received is not t:
        t.copy_(received)
