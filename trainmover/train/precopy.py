"""Pre-copy with catch-up: a planned migration's state moved before the switch.

Stop-and-copy moves the whole state (parameters and optimizer moments: three times the
parameters' bytes for AdamW) at the switch, while every stayer waits. Here the leaver sends
it during phase 1 instead, one chunk of parameters (each with its optimizer state) at each
step boundary, while the step's forward and backward run; nothing the optimizer changes is
touched until that step's optimizer pre-hook, which waits for the chunk to be on its way. From
then on, before each optimizer step, the leaver also sends the gradients its optimizer is
about to apply to the parameters already sent, with the param groups' settings (lr, ...):
the joiner replays the same ``optimizer.step()`` on its copy, which stays current. Torch's
optimizers skip a parameter without a gradient, so the joiner steps exactly the parameters
it holds, each at the version the leaver's had.

At the switch the leaver sends a last header; the joiner then receives, through the usual
transfer (``transfer.send_state``), everything the replay does not keep current: parameters
not yet sent, buffers, extra state, the generators' states and the settings.

The result is bit-identical when the registered parameters and optimizer state change only
through the registered optimizer's ``step()``, on the same kind of device (torch's
optimizers are element-wise and deterministic there). The leaver gives the pre-copy up, and
the switch copies the whole state, when it cannot be replayed (``refusal``; an optimizer
stepped with arguments, a sparse or DTensor gradient) or when the joiner lags (it has not
taken what was sent within ``precopy_max_wait`` of a step, ``PRECOPY_LAG_STEPS`` times in a
row): the job never waits long for it.

Every message travels on the migration's leaver/joiner channel with its own tag, from
``PRECOPY_TAG`` up, in the same order on both sides: a header (JSON) then its tensors, the
large ones in place and the small ones packed in one message.
"""
from __future__ import annotations

import time

import torch

from trainmover.train.state import (StateError, TrainState, _dtensor_type,
                                    _json_tensor, _jsonable, canonical_params,
                                    optim_entries_layout)
from trainmover.train.transfer import (_Chunk, _large, _pack_chunk, _unpack_chunk, recv_json,
                                       skipped)

# The pre-copy's tags on the channel, clear of the layout's and the switch transfer's.
PRECOPY_TAG = 1 << 21
# A joiner that lags (see the module doc) this many steps in a row: the pre-copy is given up.
PRECOPY_LAG_STEPS = 3


def refusal(state: TrainState) -> str | None:
    """Why this state cannot be pre-copied and replayed (None: it can)."""
    if state.model is None or state.optimizer is None:
        return "no registered model and optimizer"
    params = canonical_params(state.model)
    if any(isinstance(p, _dtensor_type()) for _, p in params):
        return "DTensor parameters (FSDP2, DTensor tensor parallelism)"
    mine = {id(p) for _, p in params}
    for group in state.optimizer.param_groups:
        if any(id(p) not in mine for p in group["params"]):
            return "the optimizer steps tensors that are not the registered model's parameters"
        for key, value in group.items():
            if key != "params" and not _jsonable(value):
                return (f"the optimizer setting {key!r} is a {type(value).__name__}, not a "
                        f"JSON value")
    return None


def _settings(state: TrainState) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in state.optimizer.param_groups]


def checksums(state: TrainState, params: frozenset[str]) -> dict[str, int]:
    """Per entry of ``params`` (each parameter and its optimizer state), the sum of its
    words (int64, wrapping): any changed word changes it. What the leaver's state and the
    joiner's replayed copy must agree on after the switch (``MigrationConfig``)."""
    tensors, _ = state.entries()
    out = {}
    with torch.no_grad():
        for name in sorted(tensors):
            if skipped(name, params):
                out[name] = _word_sum(tensors[name])
    return out


def _word_sum(t: torch.Tensor) -> int:
    """Its bytes as 8-byte words, summed (int64, wrapping), the last few bytes beside them.
    8-byte words: a sum in the words' own type runs at memory speed (23 GB/s on one core
    here), where widening 4-byte words to int64 ran at 1 GB/s: two seconds on a joiner's
    first step at 2 GB of state."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    whole = raw.numel() // 8 * 8
    total = int(raw[:whole].view(torch.int64).sum().item()) if whole else 0
    return total + sum((int(b) + 1) << (8 * i) for i, b in enumerate(raw[whole:].tolist()))


def first_difference(mine: dict[str, int], theirs: dict[str, int]) -> str | None:
    """The first entry on which two ``checksums`` disagree (None: they agree)."""
    for name in sorted(set(mine) | set(theirs)):
        if mine.get(name) != theirs.get(name):
            return name
    return None


class _Channel:
    """Both ends' view of the messages: headers and tensors, each with the next tag."""

    def __init__(self, group, peer: int):
        self.group, self.peer = group, peer
        self.tag = PRECOPY_TAG
        self.works: list = []     # (work, tensor kept alive until it is done)

    def _next(self) -> int:
        self.tag += 1
        return self.tag - 1

    def post(self, t: torch.Tensor) -> None:
        self.works.append((self.group.send(t, self.peer, tag=self._next()), t))

    def send_json(self, obj) -> None:
        blob = _json_tensor(obj).to(self.group.device)
        self.post(torch.tensor([blob.numel()], dtype=torch.int64, device=self.group.device))
        self.post(blob)

    def recv_json(self) -> dict:
        out = recv_json(self.group, self.peer, self.tag)    # a header and a blob: two tags
        self.tag += 2
        return out

    def send_tensors(self, tensors: list[torch.Tensor]) -> None:
        """Large ones in place (no copy; not to be changed until ``settle``), the small ones
        packed into one message (a copy)."""
        small = [t for t in tensors if not _large(t)]
        for t in tensors:
            if _large(t):
                self.post(t if t.is_contiguous() and t.device == self.group.device
                          else t.contiguous().to(self.group.device))
        if small:
            chunk = _Chunk(small)
            self.post(_pack_chunk(torch.empty(chunk.size, dtype=torch.uint8,
                                              device=self.group.device), chunk))

    def recv_tensors(self, tensors: list[torch.Tensor]) -> None:
        """Into ``tensors`` (the twin of ``send_tensors``, the same list in the same order)."""
        works = []
        for t in tensors:
            if _large(t):
                direct = t.is_contiguous() and t.device == self.group.device
                wire = t if direct else torch.empty(t.shape, dtype=t.dtype,
                                                    device=self.group.device)
                works.append((self.group.recv(wire, self.peer, tag=self._next()), t, wire))
        small = [t for t in tensors if not _large(t)]
        packed = None
        if small:
            chunk = _Chunk(small)
            packed = torch.empty(chunk.size, dtype=torch.uint8, device=self.group.device)
            works.append((self.group.recv(packed, self.peer, tag=self._next()), None, None))
        for work, t, wire in works:
            work.wait()
            if t is not None and wire is not t:
                t.copy_(wire)
        if packed is not None:
            _unpack_chunk(chunk, packed)

    def settle(self) -> None:
        works, self.works = self.works, []
        for work, _ in works:
            work.wait()


def _param_tensors(state: TrainState, p: torch.Tensor, keys) -> list[torch.Tensor]:
    st = state.optimizer.state.get(p, {})
    return [p.detach()] + [st[k] for k in keys]


class PrecopySender:
    """The leaver's side (see the module doc). ``at_boundary`` before each step,
    ``before_optimizer`` from the optimizer's pre-hook in a committed step, ``finish`` at the
    switch; a failure of the channel gives the pre-copy up (the migration's own failure
    handling does the rest)."""

    def __init__(self, state: TrainState, group, peer: int, chunk_bytes: int, max_wait: float,
                 emit=lambda event, **fields: None):
        self.state, self.chunk_bytes, self.max_wait, self.emit = state, chunk_bytes, max_wait, emit
        self.channel = _Channel(group, peer)
        self.params = sorted(canonical_params(state.model), key=lambda e: e[0])
        self.next = 0                 # params[:next] are sent (current on the joiner)
        self.failed: str | None = None
        self.lagging = 0
        self.steps = 0                # optimizer steps replayed by the joiner
        self.grad_bytes = 0
        self.copy_bytes = 0
        self.waited_s = 0.0
        self._last_boundary: float | None = None
        self._step_s: float | None = None
        self._t0 = time.perf_counter()
        self._announced = False

    @property
    def copied(self) -> bool:
        """Every parameter sent (or the pre-copy given up): the leaver may report ready."""
        return self.failed is not None or self.next >= len(self.params)

    def _give_up(self, reason: str) -> None:
        if self.failed is None:
            self.failed = reason
            self.emit("precopy_abandoned", reason=reason, level="warning")

    def _settle(self, budget: bool) -> None:
        """Wait for what is in flight; a wait over the budget counts as a lagging step."""
        t0 = time.perf_counter()
        try:
            self.channel.settle()
        except Exception as exc:  # noqa: BLE001 - the joiner or the channel is gone
            self._give_up(f"the channel to the joiner failed: {str(exc)[:200]}")
            return
        waited = time.perf_counter() - t0
        self.waited_s += waited
        if not budget or self._step_s is None:
            return
        if waited > self.max_wait * self._step_s:
            self.lagging += 1
            if self.lagging >= PRECOPY_LAG_STEPS:
                self._give_up(f"the joiner lagged: {waited:.3f} s waited for it at the last "
                              f"of {self.lagging} steps in a row (steps of {self._step_s:.3f} s)")
        else:
            self.lagging = 0

    def at_boundary(self, step: int) -> None:
        now = time.perf_counter()
        if self._last_boundary is not None:
            self._step_s = now - self._last_boundary
        self._last_boundary = now
        if self.failed is not None:
            return
        self._settle(budget=True)        # the last step's gradients are with the joiner
        if self.failed is not None or self.next >= len(self.params):
            return
        if not self._announced:
            self._announced = True
            total = sum(sum(t.numel() * t.element_size() for t in self._entries(p)[1])
                        for _, p in self.params)
            self.emit("precopy_started", step=step, bytes=total, params=len(self.params))
        names, layout, tensors, size = [], {}, [], 0
        while self.next < len(self.params) and (not names or size < self.chunk_bytes):
            pname, p = self.params[self.next]
            self.next += 1
            entries, ts = self._entries(p)
            names.append(pname)
            layout[pname] = entries
            tensors.extend(ts)
            size += sum(t.numel() * t.element_size() for t in ts)
        try:
            self.channel.send_json({"kind": "chunk", "step": step, "params": names,
                                    "optim": layout})
            self.channel.send_tensors(tensors)
        except Exception as exc:  # noqa: BLE001
            self._give_up(f"the channel to the joiner failed: {str(exc)[:200]}")
            return
        self.copy_bytes += size
        if self.next >= len(self.params):
            self.emit("precopy_sent", step=step, bytes=self.copy_bytes,
                      seconds=round(time.perf_counter() - self._t0, 4))

    def _entries(self, p: torch.Tensor) -> tuple[dict, list[torch.Tensor]]:
        layout = optim_entries_layout(self.state.optimizer.state.get(p, {}))
        return layout, _param_tensors(self.state, p, sorted(layout))

    def before_optimizer(self, step: int, args, kwargs) -> None:
        """The committed step's optimizer is about to run: what was sent must be out of the
        tensors it changes, and the gradients it applies go to the joiner."""
        if self.failed is not None or self.next == 0:
            return
        self._settle(budget=True)
        if self.failed is not None:
            return
        if len(args) > 1 or kwargs:     # torch passes (optimizer,) + the call's arguments
            self._give_up("the optimizer is stepped with arguments (a closure, or a fused "
                          "optimizer's AMP scaling), which a replay cannot repeat")
            return
        index, grads = [], []
        for i in range(self.next):
            _, p = self.params[i]
            g = p.grad
            if g is None:
                continue
            if g.is_sparse or isinstance(g, _dtensor_type()) or g.shape != p.shape \
                    or g.dtype != p.dtype:
                self._give_up(f"a gradient the replay cannot take ({self.params[i][0]}: "
                              f"{type(g).__name__} {g.dtype} {tuple(g.shape)})")
                return
            index.append(i)
            grads.append(g.detach())
        try:
            self.channel.send_json({"kind": "grads", "step": step, "params": index,
                                    "settings": _settings(self.state)})
            # sent in place: the optimizer reads gradients and does not change them, and the
            # next step's backward writes them only after the next boundary's settle
            self.channel.send_tensors(grads)
        except Exception as exc:  # noqa: BLE001
            self._give_up(f"the channel to the joiner failed: {str(exc)[:200]}")
            return
        self.steps += 1
        self.grad_bytes += sum(g.numel() * g.element_size() for g in grads)

    def finish(self) -> frozenset[str]:
        """At the switch, before the state transfer: the parameters the joiner holds current
        (none if the pre-copy was given up)."""
        self._settle(budget=False)
        full = self.failed is not None
        try:
            self.channel.send_json({"kind": "switch", "full": full})
            self.channel.settle()
        except Exception as exc:  # noqa: BLE001 - the switch's transfer fails the same way
            self._give_up(f"the channel to the joiner failed: {str(exc)[:200]}")
            return frozenset()
        return frozenset() if full else frozenset(n for n, _ in self.params[:self.next])

    def report(self) -> dict:
        return {"precopy_bytes": self.copy_bytes, "precopy_grad_bytes": self.grad_bytes,
                "precopy_steps": self.steps, "precopy_wait_s": self.waited_s,
                "precopy_abandoned": self.failed is not None}


class PrecopyReceiver:
    """The joiner's side: receives chunks and replays the leaver's optimizer steps until the
    switch's header; ``run`` returns the parameters it holds current."""

    def __init__(self, state: TrainState, group, peer: int, on_replay=lambda step: None):
        self.state = state
        self.on_replay = on_replay   # after each replayed step (fault injection)
        self.channel = _Channel(group, peer)
        self.params = sorted(canonical_params(state.model), key=lambda e: e[0])
        self.by_name = dict(self.params)
        self.held: list[str] = []
        self.steps = 0
        # when the last replay ended and when the switch's header came: the time between is
        # how long the joiner waited for the leaver (>= 0: the replay was off the switch's
        # critical path)
        self.replayed_at: float | None = None
        self.switch_at: float | None = None
        # where the replayed gradients are received: the gradient buckets' views when the
        # state has buckets (no extra memory), else one buffer per parameter
        self._grads: dict[int, torch.Tensor] = \
            {id(p): view for p, view in state.buckets.views} if state.buckets is not None else {}

    def run(self) -> frozenset[str]:
        while True:
            msg = self.channel.recv_json()
            kind = msg.get("kind")
            if kind == "chunk":
                self._chunk(msg)
            elif kind == "grads":
                self._replay(msg)
            elif kind == "switch":
                self.switch_at = time.perf_counter()
                return frozenset() if msg.get("full") else frozenset(self.held)
            else:
                raise StateError(f"pre-copy: unknown message {kind!r} from the leaver")

    def _chunk(self, msg: dict) -> None:
        layout = msg["optim"]
        self.state.ensure_optim(layout, self.by_name)
        tensors = []
        for pname in msg["params"]:
            tensors.extend(_param_tensors(self.state, self.by_name[pname], sorted(layout[pname])))
        with torch.no_grad():
            self.channel.recv_tensors(tensors)
        self.held.extend(msg["params"])

    def _grad_buffer(self, p: torch.Tensor) -> torch.Tensor:
        buf = self._grads.get(id(p))
        if buf is None:
            buf = self._grads[id(p)] = torch.empty_like(p, memory_format=torch.contiguous_format)
        return buf

    def _replay(self, msg: dict) -> None:
        """One step of the leaver's optimizer, on the parameters sent so far."""
        opt = self.state.optimizer
        chosen = [self.params[i][1] for i in msg["params"]]
        buffers = [self._grad_buffer(p) for p in chosen]
        self.channel.recv_tensors(buffers)
        self.state.apply_group_settings(msg["settings"])
        every = [p for group in opt.param_groups for p in group["params"]]
        before = [p.grad for p in every]     # put back after: the script's own gradients
        for p in every:
            p.grad = None                    # not stepped: the leaver's had none, or not sent
        for p, g in zip(chosen, buffers):
            p.grad = g
        try:
            opt.step()
        finally:
            for p, g in zip(every, before):
                p.grad = g
        self.steps += 1
        self.replayed_at = time.perf_counter()
        self.on_replay(msg["step"])

    def slack_s(self) -> float | None:
        """How long the joiner, caught up, waited for the switch's header (see __init__)."""
        if self.replayed_at is None or self.switch_at is None:
            return None
        return self.switch_at - self.replayed_at
