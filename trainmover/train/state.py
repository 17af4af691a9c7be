"""Training state: what a joiner receives and what a checkpoint holds, in one canonical form.

``TrainState`` is the contract between a training script and the runtime. The script
registers its model, optimizer and any extra state (``rt.register``); the runtime moves it to
a joiner (``send``/``recv``), writes it to checkpoints (``local_state``) and restores it from
either (``load``). Live transfer and checkpoints are two implementations over this one view.

A worker's *local state* maps names to this rank's tensors:

- ``model/<name>``: every entry of the model's ``state_dict`` (parameters and persistent
  buffers) under its *canonical* name (a model whose local names differ from the global ones,
  a pipeline stage numbering its blocks from 0, maps them with ``canonical_name(local)``);
- ``optim/<key>/<name>``: each tensor of the optimizer's per-parameter state (AdamW:
  ``exp_avg``, ``exp_avg_sq``, ``step``), for any optimizer;
- ``extra/<key>``: tensors given as ``extra``;
- ``meta/json``: the optimizer's param-group settings, the JSON values of ``extra`` and the
  ``state_dict`` of ``extra`` objects that have one (an LR scheduler), as UTF-8 bytes;
- ``rng/cpu`` (and ``rng/cuda``): the random generators' states.

Tensor-parallel shards declare the dimension they are split on (``SHARD_ATTR`` on the
parameter); everything else is replicated. Assembling the local states of the
data-parallel-rank-0 roles gives the *canonical state* (model and optimizer only): full
tensors, identical for any layout that trained the same model, which is what
``weights_sha256`` hashes and what the final checkpoint stores.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import json
from dataclasses import dataclass, field

import torch

from trainmover.core.topology import Layout, Role

# A parameter split over tensor-parallel ranks declares the dimension it is split on with this
# attribute; everything without it is replicated. This is the whole contract between a model
# and the runtime's state handling, so the runtime never imports a model.
SHARD_ATTR = "_tm_shard_dim"

# Entries smaller than this many elements travel packed together in one message.
_SMALL = 1024


def shard_dim(p: torch.Tensor) -> int | None:
    return getattr(p, SHARD_ATTR, None)


@functools.cache
def _dtensor_type():
    """DTensor's class, looked up once (every entry of a transfer asks)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:          # a torch without DTensor: no tensor is one
        return ()
    return DTensor


def mesh_axes(mesh) -> list[str | None]:
    """The job axis ("dp", "pp", "tp") of each dimension of a DeviceMesh, by its dimension
    names (``rt.device_mesh()`` names them after the axes); None where unnamed."""
    names = mesh.mesh_dim_names or ()
    return [n if n in ("dp", "pp", "tp") else None for n in names] or [None] * mesh.ndim


def placement_dims(t, axes_of=mesh_axes) -> dict[str, int]:
    """For a DTensor: the tensor dimension it is sharded on along each job axis (``{"dp":
    0}`` under FSDP2 over the dp axis); {} for a plain or replicated tensor."""
    if not isinstance(t, _dtensor_type()):
        return {}
    out = {}
    for axis, placement in zip(axes_of(t.device_mesh), t.placements):
        # FSDP2 over a tensor-parallel parameter shards along dp with a _StridedShard,
        # which is not a Shard (is_shard() is False) but splits the tensor all the same
        if placement.is_shard() or _is_strided_shard(placement):
            if axis is None:
                raise StateError(f"a DTensor is sharded along a mesh dimension that is not "
                                 f"one of the job's axes ({t.device_mesh}): build its mesh "
                                 f"with rt.device_mesh() or from rt.groups.*.process_group")
            out[axis] = placement.dim
    return out


def _is_strided_shard(placement) -> bool:
    return type(placement).__name__ == "_StridedShard"


def dtensor_box(t) -> tuple[list[int], list[int]] | None:
    """For a DTensor: (global shape, offset of this process's shard in it), found by the
    function DCP uses to save DTensors, so that any nesting of shardings (FSDP2 inside
    tensor parallelism splits a strided shard) assembles; None for a plain tensor."""
    if not isinstance(t, _dtensor_type()):
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return list(t.shape), list(offset)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this process holds: a DTensor's local shard (an alias: writing it writes
    the DTensor), a plain tensor itself."""
    return t.to_local().detach() if isinstance(t, _dtensor_type()) else t.detach()


# torch.compile wraps a module in an OptimizedModule that holds it as ``_orig_mod``: its
# names gain that part, and a compiled run's state would not match an eager run's by name
_COMPILED = "_orig_mod."


def _rename(model: torch.nn.Module):
    rename = getattr(model, "canonical_name", None)
    if rename is None:
        rename = getattr(getattr(model, "_orig_mod", None), "canonical_name", None)
    base = rename if rename is not None else (lambda n: n)
    return lambda n: base(n.replace(_COMPILED, ""))


def canonical_params(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """Parameters under their canonical names."""
    rename = _rename(model)
    return [(rename(n), p) for n, p in model.named_parameters()]


@dataclass
class TransferView:
    """A state as a transfer moves it (``TrainState.transfer_view``): the tensors by name (in
    name order), the optimizer's layout and that layout as sent (JSON bytes: two sides hold
    the same layout exactly when these are equal). ``plans``: what the transfer derives from
    the view (``train/transfer.py``), kept with it. Read-only to its users."""
    tensors: dict[str, torch.Tensor]
    layout: dict[str, dict[str, list]]
    layout_blob: torch.Tensor
    plans: dict = field(default_factory=dict)


class StateError(ValueError):
    """State that does not fit the registered model and optimizer (a checkpoint or transfer
    made for another model, a missing entry)."""


class TrainState:
    """The registered state of one worker (see the module doc)."""

    def __init__(self, model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None,
                 extra: dict | None = None, buckets=None, axes_of=mesh_axes):
        self.model, self.optimizer = model, optimizer
        self.axes_of = axes_of   # DeviceMesh -> the job axis of each of its dimensions
        self.extra = extra if extra is not None else {}
        self.buckets = buckets   # GradBuckets over the model's parameters, or None
        if not isinstance(self.extra, dict):
            raise TypeError(f"extra must be a dict, got {type(self.extra).__name__}")
        for key in self.extra:
            if not isinstance(key, str) or "/" in key:
                raise ValueError(f"extra keys must be strings without '/', got {key!r}")
        self._param_names = {id(p): n for n, p in canonical_params(model)} \
            if model is not None else {}
        self._view = None   # transfer_view's, with the _identity it was built for

    # --- the named view ------------------------------------------------------------------
    def _live(self, layout: dict[str, dict[str, list]] | None = None
              ) -> list[tuple[str, torch.Tensor, torch.Tensor | None]]:
        """(name, live tensor as registered, its parameter or None), sorted by name.
        ``layout``, if given, is filled with the optimizer's layout (``_optim_layout``) on
        the same walk: a transfer needs both, and the walk is per-entry Python."""
        out = []
        if self.model is not None:
            rename = _rename(self.model)
            params = {id(p): p for p in self.model.parameters()}
            for local, t in self.model.state_dict(keep_vars=True).items():
                out.append((f"model/{rename(local)}", t, t if id(t) in params else None))
        if self.optimizer is not None:
            for p, st in self.optimizer.state.items():
                pname = self._param_names.get(id(p))
                if pname is None:
                    continue
                entries = {}
                for key in sorted(st):
                    v = st[key]
                    if isinstance(v, torch.Tensor):
                        out.append((f"optim/{key}/{pname}", v, p if v.shape == p.shape else None))
                        entries[key] = _entry_layout(v)
                if layout is not None:
                    layout[pname] = entries
        for key, v in sorted(self.extra.items()):
            if isinstance(v, torch.Tensor):
                out.append((f"extra/{key}", v, None))
        return sorted(out, key=lambda e: e[0])

    def tensors(self) -> dict[str, torch.Tensor]:
        """``entries()``'s tensors alone (what a transfer moves: no shard dimensions)."""
        return {name: _local(t) for name, t, _ in self._live()}

    def transfer_view(self) -> "TransferView":
        """What a transfer moves (``tensors()``, but the live tensors themselves: a parameter
        whose ``.data`` was replaced is read as it is now) and the optimizer's layout
        (``_optim_layout()``), from one walk of the state. Kept while ``_identity()`` stays
        the same, so a transfer after the first (every planned migration, as a worker's
        roles come and go) pays for a cheaper walk.

        The view holds the state's tensors: a transfer releases it when done
        (``release_view``), as does an abandoned migration and a change of the optimizer's
        entries here (``_match_optim``), so that it never keeps a replaced tensor's memory
        beyond a migration's phase 1 (the only time it is kept between transfers)."""
        identity = self._identity()
        if self._view is not None and self._view[0] == identity:
            return self._view[1]
        layout: dict[str, dict[str, list]] = {}
        with torch.no_grad():   # a DTensor's local tensor itself, not an autograd view
            tensors = {name: t.to_local() if isinstance(t, _dtensor_type()) else t
                       for name, t, _ in self._live(layout)}
        view = TransferView(tensors, layout, _json_tensor(layout))
        self._view = (identity, view)
        return view

    def release_view(self) -> None:
        """Drop the view ``transfer_view`` keeps (and the tensors it holds)."""
        self._view = None

    def _identity(self) -> list:
        """What ``transfer_view`` depends on: every registered tensor's key, object, local
        tensor (a DTensor's), shape, dtype and device, in the state's own order. One tuple
        an entry: about a third of building the view (names, sorting, the layout)."""
        values = []
        if self.model is not None:
            values += self.model.state_dict(keep_vars=True).items()
        if self.optimizer is not None:
            for p, st in self.optimizer.state.items():
                values.append((None, p))
                values += st.items()
        values += self.extra.items()
        return [(k, id(v), id(getattr(v, "_local_tensor", v)), v.shape, v.dtype, v.device)
                if isinstance(v, torch.Tensor) else (k, None) for k, v in values]

    def entries(self) -> tuple[dict[str, torch.Tensor], dict[str, int | None]]:
        """The live tensors this process holds, by name (no copies: a DTensor's local shard),
        and each entry's tensor-parallel shard dimension."""
        tensors: dict[str, torch.Tensor] = {}
        dims: dict[str, int | None] = {}
        for name, t, param in self._live():
            tensors[name] = _local(t)
            placed = placement_dims(t, self.axes_of)
            dims[name] = placed.get("tp", shard_dim(param) if param is not None else None)
        return tensors, dims

    def dp_dims(self) -> dict[str, int]:
        """The entries sharded over the data-parallel axis (FSDP2), and the dimension: what
        assembles the canonical state from every dp role's share (``Layout.dp_sharded``)."""
        out = {}
        for name, t, _ in self._live():
            dim = placement_dims(t, self.axes_of).get("dp")
            if dim is not None:
                out[name] = dim
        return out

    def boxes(self) -> dict[str, tuple[list[int], list[int]]]:
        """Each DTensor entry's global shape and this process's offset in it (``dtensor_box``):
        what assembles the canonical state of DTensor state from the roles' shares."""
        out = {}
        for name, t, _ in self._live():
            box = dtensor_box(t)
            if box is not None:
                out[name] = box
        return out

    def meta(self, with_layout: bool = True) -> dict:
        """Everything of the state that is not a tensor, as JSON values. ``with_layout``:
        with the optimizer's layout (a transfer sends its own, ``TransferView``)."""
        groups = []
        if self.optimizer is not None:
            for g in self.optimizer.param_groups:
                groups.append({k: v for k, v in g.items() if k != "params" and _jsonable(v)})
        extra = {}
        for key, v in sorted(self.extra.items()):
            if isinstance(v, torch.Tensor):
                continue
            if hasattr(v, "state_dict") and hasattr(v, "load_state_dict"):
                extra[key] = {"state_dict": v.state_dict()}
            else:
                extra[key] = {"value": v}
        try:
            # the registered extras are the only part that may not be JSON (the settings are
            # filtered, the layout is built of lists, strings and ints)
            json.dumps(extra)
        except TypeError as exc:
            raise ValueError(f"registered extra state is not JSON-serializable: {exc}") from exc
        out = {"param_groups": groups, "extra": extra}
        if with_layout:
            out["optim_state"] = self._optim_layout()
        return out

    def _optim_layout(self) -> dict[str, dict[str, list]]:
        """Per parameter, the optimizer state entries (shape, dtype): what a receiver that has
        not stepped yet must allocate before it can receive into them."""
        out: dict[str, dict[str, list]] = {}
        if self.optimizer is None:
            return out
        for p, st in self.optimizer.state.items():
            pname = self._param_names.get(id(p))
            if pname is None:
                continue
            out[pname] = optim_entries_layout(st)
        return out

    def _apply_meta(self, meta: dict) -> bool:
        """Returns whether the optimizer's state entries changed (``_match_optim``): the
        only change of it that ``entries()`` sees."""
        if self.optimizer is not None and meta.get("param_groups"):
            self.apply_group_settings(meta["param_groups"])
        for key, saved in meta.get("extra", {}).items():
            if key not in self.extra:
                raise StateError(f"state has extra entry {key!r}, which was not registered")
            target = self.extra[key]
            if "state_dict" in saved:
                target.load_state_dict(saved["state_dict"])
            else:
                self.extra[key] = saved["value"]
        return self._match_optim(meta.get("optim_state"))

    def _match_optim(self, layout: dict[str, dict[str, list]] | None) -> bool:
        """Give the live optimizer the state entries of ``layout`` (the sender's, or the
        checkpoint's): create those it lacks (a fresh optimizer creates its state lazily, at
        its first step) and drop those the layout lacks (a rollback to a checkpoint taken
        before the first step: the optimizer is fresh again, as it was then). Returns
        whether it created or dropped any."""
        if self.optimizer is None or layout is None:
            return False
        by_name = {n: p for n, p in canonical_params(self.model)}
        changed = False
        for pname, p in by_name.items():
            st = self.optimizer.state.get(p)
            if st is None:
                continue
            if pname not in layout:
                del self.optimizer.state[p]
                changed = True
                continue
            for key in [k for k, v in st.items()
                        if isinstance(v, torch.Tensor) and k not in layout[pname]]:
                del st[key]
                changed = True
        changed = self.ensure_optim(layout, by_name) > 0 or changed
        if changed:
            self.release_view()
        return changed

    def apply_group_settings(self, saved: list[dict]) -> None:
        """The optimizer's param-group settings (lr, betas, weight decay, ...) from their
        JSON form (``meta()``'s ``param_groups``)."""
        if len(saved) != len(self.optimizer.param_groups):
            raise StateError(f"state has {len(saved)} optimizer param groups, this optimizer "
                             f"{len(self.optimizer.param_groups)}")
        for g, values in zip(self.optimizer.param_groups, saved):
            # the settings travel as JSON, which has no tuples: Adam's betas stay one
            g.update({k: tuple(v) if isinstance(g.get(k), tuple) and isinstance(v, list)
                      else v for k, v in values.items()})

    def ensure_optim(self, layout: dict[str, dict[str, list]], by_name: dict | None = None
                     ) -> int:
        """Create (zeroed) the optimizer state entries of ``layout`` this optimizer lacks;
        returns how many."""
        created = 0
        if by_name is None:
            by_name = {n: p for n, p in canonical_params(self.model)}
        for pname, entries in layout.items():
            if pname not in by_name:
                raise StateError(f"state has optimizer entries for {pname!r}, which is not a "
                                 f"parameter of this model")
            p = by_name[pname]
            st = self.optimizer.state[p]
            for key, (shape, dtype, where) in entries.items():
                if key in st:
                    continue
                if where == "dtensor":
                    if not isinstance(p, _dtensor_type()) or list(p.shape) != shape:
                        raise StateError(f"state has a sharded {key!r} for {pname!r}, which "
                                         f"is not a sharded parameter of this shape here")
                    # a sharded parameter's moments are sharded like it (FSDP2)
                    st[key] = torch.zeros_like(p, dtype=getattr(torch, dtype))
                else:
                    st[key] = torch.zeros(shape, dtype=getattr(torch, dtype),
                                          device="cpu" if where == "cpu" else p.device)
                created += 1
        return created

    # --- checkpoints -----------------------------------------------------------------------
    def local_state(self) -> tuple[dict[str, torch.Tensor], dict[str, int | None]]:
        """Named tensors for a checkpoint (live tensors: the caller copies them)."""
        tensors, dims = self.entries()
        tensors["meta/json"] = _json_tensor(self.meta())
        dims["meta/json"] = None
        for name, rng in _rng_states().items():
            tensors[name] = rng
            dims[name] = None
        return tensors, dims

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Overwrite the live state from a local state (the inverse of ``local_state``)."""
        if "meta/json" in tensors:
            self._apply_meta(_from_json_tensor(tensors["meta/json"]))
        live, _ = self.entries()
        missing = sorted(set(live) - set(tensors))
        if missing:
            raise StateError(f"state lacks {len(missing)} entries of this model, e.g. "
                             f"{missing[0]!r}")
        with torch.no_grad():
            for name, t in live.items():
                src = tensors[name]
                if src.shape != t.shape:
                    raise StateError(f"state entry {name!r} has shape {tuple(src.shape)}, this "
                                     f"model {tuple(t.shape)}")
                t.copy_(src)
        _set_rng_states({k: v for k, v in tensors.items() if k.startswith("rng/")})

    # --- live transfer ---------------------------------------------------------------------


def optim_entries_layout(st: dict) -> dict[str, list]:
    """One parameter's optimizer state entries: key -> [shape, dtype, where]. Where each
    lives: AdamW keeps its step count on the CPU even for CUDA parameters (unless
    capturable), and refuses it anywhere else; a moment of a sharded parameter (FSDP2) is a
    DTensor placed like it."""
    return {k: _entry_layout(v) for k, v in sorted(st.items()) if isinstance(v, torch.Tensor)}


def _entry_layout(v: torch.Tensor) -> list:
    return [list(v.shape), _dtype_name(v.dtype),
            "dtensor" if isinstance(v, _dtensor_type()) else
            "cpu" if v.device.type == "cpu" else "param"]


@functools.cache
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _jsonable(v) -> bool:
    try:
        json.dumps(v)
        return True
    except TypeError:
        return False


def _json_tensor(obj) -> torch.Tensor:
    raw = json.dumps(obj, sort_keys=True).encode()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()


def _from_json_tensor(t: torch.Tensor) -> dict:
    return json.loads(bytes(t.cpu().numpy().tobytes()).decode()) if t.numel() else {}


def _rng_states() -> dict[str, torch.Tensor]:
    out = {"rng/cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["rng/cuda"] = torch.cuda.get_rng_state()
    return out


def _set_rng_states(states: dict[str, torch.Tensor]) -> None:
    if "rng/cpu" in states:
        torch.set_rng_state(states["rng/cpu"].cpu())
    if "rng/cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["rng/cuda"].cpu())


# --- the canonical state ---------------------------------------------------------------------

CANONICAL_PREFIXES = ("model/", "optim/")


def assemble(shards: dict[Role, tuple], layout: Layout) -> dict[str, torch.Tensor]:
    """Canonical full tensors (model and optimizer) from the local states ``(tensors, tp
    dims[, dp dims[, boxes]])`` of every (pp, tp) of data-parallel rank 0, or of every role
    when the dp roles hold shards (``Layout.dp_sharded``). A DTensor entry (one with a box:
    global shape and offset) is placed where its box says; a plain one with a dp dimension
    is the concatenation of the dp roles' shares along it, then along its tp dimension. A
    name held by two pipeline stages is an error: stage models must use globally unique
    (canonical) names."""
    out: dict[str, torch.Tensor] = {}
    owner: dict[str, int] = {}
    for pp in range(layout.pp):
        column = [[shards[Role(dp, pp, tp)] for dp in (range(layout.dp) if layout.dp_sharded
                                                       else [0])]
                  for tp in range(layout.tp)]
        for name, dim in column[0][0][1].items():
            if not name.startswith(CANONICAL_PREFIXES):
                continue
            if name in owner:
                raise StateError(f"state entry {name!r} is held by pipeline stages "
                                 f"{owner[name]} and {pp}: give each stage's parameters "
                                 f"globally unique names (a canonical_name(local) method)")
            owner[name] = pp
            if name in _part(column[0][0], 3):
                out[name] = _from_boxes(name, [p for parts in column for p in parts])
                continue
            per_tp = [_over_dp(name, parts) for parts in column]
            out[name] = per_tp[0] if dim is None else torch.cat(per_tp, dim=dim)
    return dict(sorted(out.items()))


def _part(shard: tuple, i: int) -> dict:
    return shard[i] if len(shard) > i else {}


def _over_dp(name: str, parts: list[tuple]) -> torch.Tensor:
    """One tensor-parallel rank's full entry from its dp roles' shares."""
    dp_dim = _part(parts[0], 2).get(name)
    if dp_dim is None or len(parts) == 1:
        return parts[0][0][name].detach().cpu().clone()
    return torch.cat([p[0][name].detach().cpu() for p in parts], dim=dp_dim)


def _from_boxes(name: str, parts: list[tuple]) -> torch.Tensor:
    """A DTensor entry's full tensor from every role's share, each placed at its offset.
    Replicated shares land on the same elements with the same values; every element must be
    covered by some share (else a share is missing: an error, not zeros in the result)."""
    shape = _part(parts[0], 3)[name][0]
    first = parts[0][0][name]
    full = torch.empty(shape, dtype=first.dtype)
    covered = torch.zeros(shape, dtype=torch.bool)
    for p in parts:
        local = p[0][name].detach().cpu()
        gshape, offset = _part(p, 3)[name]
        if list(gshape) != list(shape):
            raise StateError(f"state entry {name!r}: roles disagree on its global shape "
                             f"({shape} and {gshape})")
        index = tuple(slice(o, o + n) for o, n in zip(offset, local.shape))
        full[index] = local
        covered[index] = True
    if not bool(covered.all()):
        raise StateError(f"state entry {name!r}: the roles' shares cover "
                         f"{int(covered.sum())} of its {covered.numel()} elements")
    return full


def state_digest(state: dict[str, torch.Tensor]) -> str:
    """sha256 over names, dtypes, shapes and raw bytes, in sorted name order."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()))
    return h.hexdigest()
