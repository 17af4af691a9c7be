"""JSON for the runtime's own plain data (the controller's snapshot): the dataclasses and
enums a codec is given, lists, tuples, sets and dicts with string keys. Nothing else is
written, and decoding builds only the registered types, checking each simple field's type,
so a value read back from the store can never run code (unlike pickle).

    codec = Codec(Membership, Role, Layout, StandbyState)
    text = codec.dumps(membership)
    same = codec.loads(text)
"""
from __future__ import annotations

import dataclasses
import enum
import json
import types
import typing


class SnapshotError(ValueError):
    """A value that cannot be written as, or read back from, the codec's JSON."""


_SIMPLE = (bool, int, float, str)


def _same(obj):
    return obj


class Codec:
    def __init__(self, *registered: type, max_bytes: int = 64 * 2**20):
        self.types = {t.__name__: t for t in registered}
        if len(self.types) != len(registered):
            raise ValueError("two registered types share a name")
        self.max_bytes = max_bytes
        self._hints: dict[type, dict] = {}
        self._encoders: dict[type, typing.Callable] = {}

    # --- writing ------------------------------------------------------------------------------
    def dumps(self, obj) -> str:
        # encode() builds a fresh tree (no value appears twice in it): nothing to check for
        # cycles
        return json.dumps(self.encode(obj), sort_keys=True, separators=(",", ":"),
                          check_circular=False)

    def encode(self, obj):
        # one encoder per class, made at its first value (the controller encodes its whole
        # snapshot every busy round: thousands of dataclasses, whose fields and registration
        # were looked up again for each one)
        cls = type(obj)
        enc = self._encoders.get(cls)
        if enc is None:
            enc = self._encoders[cls] = self._encoder_for(cls)
        return enc(obj)

    def _encoder_for(self, cls: type):
        encode = self.encode
        if cls is type(None) or issubclass(cls, _SIMPLE) and not issubclass(cls, enum.Enum):
            return _same
        if issubclass(cls, enum.Enum):
            self._check_registered(cls)
            return lambda obj: {"__enum__": cls.__name__, "value": obj.value}
        if dataclasses.is_dataclass(cls):
            self._check_registered(cls)
            skip = getattr(cls, "__snapshot_exclude__", ())
            names = [f.name for f in dataclasses.fields(cls) if f.init and f.name not in skip]
            return lambda obj: {"__type__": cls.__name__,
                                "fields": {n: encode(getattr(obj, n)) for n in names}}
        if issubclass(cls, (list, tuple)):
            return lambda obj: [encode(v) for v in obj]
        if issubclass(cls, (set, frozenset)):
            return lambda obj: {"__set__": sorted((encode(v) for v in obj), key=json.dumps)}
        if issubclass(cls, dict):
            return self._encode_dict
        raise SnapshotError(f"cannot encode a {cls.__name__} (not a registered type)")

    def _encode_dict(self, obj: dict) -> dict:
        out = {}
        for k, v in obj.items():
            if not isinstance(k, str) or k.startswith("__"):
                raise SnapshotError(f"dict key {k!r}: keys must be strings not starting "
                                    f"with '__'")
            out[k] = self.encode(v)
        return out

    def _check_registered(self, cls: type) -> None:
        if self.types.get(cls.__name__) is not cls:
            raise SnapshotError(f"type {cls.__name__} is not registered with this codec")

    # --- reading ------------------------------------------------------------------------------
    def loads(self, text: str | bytes):
        if len(text) > self.max_bytes:
            raise SnapshotError(f"snapshot of {len(text)} bytes exceeds {self.max_bytes}")
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise SnapshotError(f"not JSON: {exc}") from exc
        return self.decode(data)

    def decode(self, data):
        if data is None or isinstance(data, _SIMPLE):
            return data
        if isinstance(data, list):
            return [self.decode(v) for v in data]
        if not isinstance(data, dict):
            raise SnapshotError(f"unexpected JSON value {data!r}")
        if "__type__" in data:
            return self._decode_dataclass(data)
        if "__enum__" in data:
            cls = self._registered(data["__enum__"])
            try:
                return cls(data.get("value"))
            except ValueError as exc:
                raise SnapshotError(str(exc)) from exc
        if "__set__" in data:
            return {_hashable(self.decode(v)) for v in data["__set__"]}
        return {k: self.decode(v) for k, v in data.items()}

    def _registered(self, name) -> type:
        cls = self.types.get(name) if isinstance(name, str) else None
        if cls is None:
            raise SnapshotError(f"unknown type {name!r}")
        return cls

    def _decode_dataclass(self, data: dict):
        cls = self._registered(data["__type__"])
        fields = data.get("fields")
        if not isinstance(fields, dict):
            raise SnapshotError(f"{cls.__name__}: no fields")
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise SnapshotError(f"{cls.__name__}: unknown field(s) {unknown}")
        values = {k: self.decode(v) for k, v in fields.items()}
        if cls not in self._hints:
            try:
                self._hints[cls] = typing.get_type_hints(cls)
            except Exception:  # noqa: BLE001 - an annotation that does not resolve: no checks
                self._hints[cls] = {}
        hints = self._hints[cls]
        for name, value in values.items():
            if not _simple_type_ok(hints.get(name), value):
                raise SnapshotError(f"{cls.__name__}.{name}: {value!r} is not a "
                                    f"{hints.get(name)}")
        try:
            return cls(**values)
        except TypeError as exc:
            raise SnapshotError(f"{cls.__name__}: {exc}") from exc


def _hashable(v):
    return tuple(v) if isinstance(v, list) else v


def _simple_type_ok(hint, value) -> bool:
    """Checks fields declared as a simple type (or that type or None); others pass."""
    if hint is None:
        return True
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) or \
        typing.get_origin(hint) is typing.Union else (hint,)
    if not all(o is type(None) or o in _SIMPLE for o in options):
        return True
    if value is None:
        return type(None) in options
    for o in options:
        if o is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return True
        if o is int and isinstance(value, int) and not isinstance(value, bool):
            return True
        if o in (str, bool) and isinstance(value, o):
            return True
    return False
