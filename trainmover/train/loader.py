"""A stateful data loader registered with the runtime (``rt.register(data=loader)``): its
position moves with the role and a redone step gets the batches of its first attempt.

For a loader whose batches are not a pure function of the step: anything iterable with
``state_dict()`` / ``load_state_dict()`` (torchdata's ``StatefulDataLoader``, with workers
and prefetching; a script's own resumable iterator). The script iterates ``rt.batches()``
instead of the loader:
- a step redone after a failure is handed the batches its first attempt fetched, in order,
  from a copy kept for the step (the loader's workers may have prefetched past them: its
  own state cannot be rewound under a live iterator);
- the loader's state (``state_dict()``) is part of the role's state: it moves to a joiner
  at a migration's switch, goes into checkpoints, and a role that recovers from a replica
  or a checkpoint continues from its position. Between steps it is the loader's state; in
  a step not yet committed it is the state the step started from, so a replica that serves
  a recovery mid-step hands over the position the redone step starts at;
- the loader is never asked for its state before its first batch (a StatefulDataLoader
  without a live iterator makes one to answer, drawing from torch's global generator): the
  state then is the one loaded, or "from the start";
- loading a state (a joiner, a rollback) restarts the iteration from it, without the draw
  from torch's global generator that making a DataLoader iterator takes (the run's first
  iterator took it; a second would shift every later random number). The new iterator's
  workers therefore get another base seed: a dataset that draws random numbers in its
  workers (augmentation) is not yet exact across a move.
The state is carried as ``torch.save`` bytes (loaded with ``weights_only=True``: tensors,
numbers, strings and containers, never code), base64 in the role's JSON metadata.

Kept per step: the batches of one attempt, copied (a script may change a batch in place).
"""
from __future__ import annotations

import base64
import io
from collections import deque

import torch
from torch.utils._pytree import tree_map


class DataUnsupported(ValueError):
    """The object given as ``data`` is not a resumable iterable."""


def _copy(batch):
    return tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, batch)


def _encode(state) -> dict:
    buf = io.BytesIO()
    torch.save(state, buf)
    return {"torch_save_b64": base64.b64encode(buf.getvalue()).decode()}


def _decode(saved: dict):
    raw = base64.b64decode(saved["torch_save_b64"])
    return torch.load(io.BytesIO(raw), weights_only=True)


class RegisteredData:
    """The runtime's side of a registered loader (see the module doc); its ``state_dict``
    and ``load_state_dict`` make it an ``extra`` entry of the role's state."""

    def __init__(self, loader):
        missing = [m for m in ("state_dict", "load_state_dict", "__iter__")
                   if not hasattr(loader, m)]
        if missing:
            raise DataUnsupported(
                f"rt.register(data=...): {type(loader).__name__} has no "
                f"{', '.join(missing)}: give a loader whose position can be saved and "
                f"restored (torchdata's StatefulDataLoader), or make the batch a function of "
                f"the step and register nothing")
        self.loader = loader
        self._it = None
        self._resumed = False              # the next iterator continues a loaded position
        self._step: int | None = None      # the step whose batches are being kept
        self._fetched: list = []           # this attempt's batches, copied
        self._replay: deque = deque()      # the first attempt's, for a redo
        self._start_state = None           # the loader's state when the step started
        self._in_step = False              # a step started and not committed yet
        self._loaded = None                # the state loaded last, until the next batch

    # --- the runtime's hooks --------------------------------------------------------------
    def step_started(self, step: int) -> None:
        if self._in_step and self._step == step:      # a redo of the same attempt's step
            self._replay = deque(self._fetched + list(self._replay))
            self._fetched = []
            return
        self._step, self._fetched, self._replay = step, [], deque()
        self._start_state = self._position()
        self._in_step = True

    def step_committed(self) -> None:
        self._in_step, self._fetched, self._replay = False, [], deque()

    # --- the script's iterator ------------------------------------------------------------
    def __iter__(self):
        return self

    def __next__(self):
        if self._replay:
            batch = self._replay.popleft()
        else:
            if self._it is None:
                self._it = self._iterator()
            batch = next(self._it)
        if self._in_step:
            self._fetched.append(_copy(batch))
        return batch

    def _iterator(self):
        """A DataLoader's iterator draws its workers' base seed from torch's global generator
        when it is made. The run's first one does so where the plain script's does; one made
        again to continue a loaded position (a joiner, a rollback) must not, or every later
        draw (dropout) would be one off the uninterrupted run's."""
        if not self._resumed:
            return iter(self.loader)
        self._resumed = False
        with torch.random.fork_rng(devices=[]):
            return iter(self.loader)

    # --- as state -------------------------------------------------------------------------
    def _position(self):
        """The loader's state now. Before its first batch it is the position loaded, or
        None (from the start): a StatefulDataLoader asked for its state without a live
        iterator makes one, drawing from torch's global generator where the script's
        own iteration would not (a joiner's dropout would be one draw off)."""
        if self._it is None:
            return self._loaded
        return self.loader.state_dict()

    def state_dict(self) -> dict:
        state = self._start_state if self._in_step else self._position()
        return {"from_start": True} if state is None else _encode(state)

    def load_state_dict(self, saved: dict) -> None:
        self._it = None                   # the next batch comes from the loaded position
        self._in_step, self._fetched, self._replay = False, [], deque()
        if saved.get("from_start"):       # a role that had not drawn a batch yet
            self._loaded, self._resumed = None, False
            return
        self._loaded = _decode(saved)
        self.loader.load_state_dict(self._loaded)
        self._resumed = True
