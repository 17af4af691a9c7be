"""JSON for the runtime's own plain data (the controller's snapshot): the dataclasses and
enums a codec is given, lists, tuples, sets and dicts with string keys. Nothing else is
written, and decoding builds only the registered types, checking each simple field's type,
so a value read back from the store can never run code (unlike pickle).

    codec = Codec(Membership, Role, Layout, StandbyState)
    text = codec.dumps(membership)
    same = codec.loads(text)

A ``Table`` (a dict that stamps its changes, by part of its keys) is written once and its
JSON kept: the next ``dumps`` encodes again only the parts that changed, and in those only
the entries whose value is another object; a copy of a table (a new membership) starts
from the JSON of the table it copies. The controller saves its snapshot every busy round,
and most of it is tables of a line a worker that rarely change (who holds which role,
which process runs where): encoding them again each time was 0.2-0.3 s a save at 16K
workers, the most of a round; encoded by whole part, a round of a recovery (a few of its
reports or process records changed in every part) or a new membership still took 30-115
ms a save at 4K workers.

A large table can also be written as *parts*: ``dumps(state, parts={}, part_min_bytes=n)``
puts each part's JSON in ``parts`` under its digest and writes the table as the list of its parts'
digests; ``loads(text, fetch)`` gets the parts a text names from ``fetch`` and checks each
against its digest. Whoever keeps a snapshot that way writes a part once and then only the
parts that changed, not the whole text (4.8 MB at 16K workers) every save.
"""
from __future__ import annotations

import dataclasses
import enum
import hashlib
import itertools
import json
import re
import secrets
import types
import typing
import weakref
import zlib


class SnapshotError(ValueError):
    """A value that cannot be written as, or read back from, the codec's JSON."""


_SIMPLE = (bool, int, float, str)


def _same(obj):
    return obj


TABLE_SHARDS = 64          # a Table's keys fall in this many parts, each encoded on its own


PART_DIGEST_CHARS = 32        # hex characters of a part's SHA-256 that name it (128 bits)
_DIGEST = re.compile(f"[0-9a-f]{{{PART_DIGEST_CHARS}}}")


def part_digest(text: str) -> str:
    """The name of a table part: its JSON's SHA-256, shortened."""
    return hashlib.sha256(text.encode()).hexdigest()[:PART_DIGEST_CHARS]


def _shard(key) -> int:
    # a fixed function of the key (not hash(): salted per process), so that a resumed
    # controller splits a table as its predecessor did
    return zlib.crc32(str(key).encode()) % TABLE_SHARDS


_STAMPS = itertools.count()     # every Table's change stamps (``Table.versions``)


class Table(dict):
    """A dict that stamps its changes, by part of its keys (``versions``), so that
    ``Codec.dumps`` encodes again only the parts that changed. A stamp is drawn from one
    count for every table (``_STAMPS``): a part of a given stamp has one content, in the
    table that stamped it and in its copies (which start at their origin's stamps), so a
    copy changed one way and its origin another never share one. Every change through its
    methods counts; a value changed in place would not, so its values must be immutable
    (numbers, strings, enums, frozen dataclasses)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.versions = [next(_STAMPS)] * TABLE_SHARDS
        # the table this one is a copy of, while it lives: a codec that wrote that one
        # starts from its JSON (``Codec._encode_table``)
        self.origin: weakref.ref | None = None
        if len(args) == 1 and not kwargs and isinstance(args[0], Table):
            # a copy (a membership's, at each migration and recovery): its parts as they
            # are, not a checksum of every key again (15x slower at 64K workers), and at
            # the origin's stamps
            source = args[0]
            self.shards: list[dict] = [dict(keys) for keys in source.shards]
            self.versions = list(source.versions)
            self.origin = weakref.ref(source)
            return
        self.shards = [{} for _ in range(TABLE_SHARDS)]   # each part's keys
        for key in self:
            self.shards[_shard(key)][key] = None

    def _changed(self, key, present: bool) -> None:
        i = _shard(key)
        if present:
            self.shards[i][key] = None
        else:
            self.shards[i].pop(key, None)
        self.versions[i] = next(_STAMPS)

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self._changed(key, True)

    def __delitem__(self, key):
        super().__delitem__(key)
        self._changed(key, False)

    def __ior__(self, other):
        self.update(other)
        return self

    def pop(self, key, *default):
        if key in self:
            self._changed(key, False)
        return super().pop(key, *default)

    def popitem(self):
        key, value = super().popitem()
        self._changed(key, False)
        return key, value

    def clear(self):
        super().clear()
        for i in range(TABLE_SHARDS):
            self.shards[i].clear()
            self.versions[i] = next(_STAMPS)

    def update(self, *args, **kwargs):
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = default
        return self[key]

    def copy(self) -> "Table":
        return Table(self)

    def __reduce__(self):
        # pickled or deep-copied: a table of its own (new stamps, no origin to follow)
        return (Table, (dict(self),))


# encode() builds a fresh tree (no value appears twice in it): nothing to check for cycles.
# One encoder for every call: a table's entries are encoded one by one
_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), check_circular=False)
_json = _ENCODER.encode
_key_json = json.encoder.encode_basestring_ascii    # a key's JSON, as _ENCODER writes it


@dataclasses.dataclass(eq=False)
class _TableJSON:
    """A table's JSON as the last ``dumps`` wrote it, by part (``Codec._encode_table``)."""

    table: Table                  # (a strong reference: its id is not reused meanwhile)
    versions: list[int] = dataclasses.field(default_factory=lambda: [-1] * TABLE_SHARDS)
    texts: list[str] = dataclasses.field(default_factory=lambda: [""] * TABLE_SHARDS)
    digests: list[str | None] = dataclasses.field(
        default_factory=lambda: [None] * TABLE_SHARDS)
    whole: str | None = None      # the table's JSON, inline
    refs: str | None = None       # the table as its parts' digests
    # each part's entries as written: key -> value, key -> '"key":value' as JSON (two dicts,
    # no pair objects: the second holds strings only, which the garbage collector skips).
    # A part that changed is joined again from these, encoding only the entries whose value
    # is another object (values are immutable): a recovery's reports or the process table
    # change in most parts at once, a few entries in each
    values: list[dict] = dataclasses.field(
        default_factory=lambda: [{} for _ in range(TABLE_SHARDS)])
    entries: list[dict] = dataclasses.field(
        default_factory=lambda: [{} for _ in range(TABLE_SHARDS)])

    def copy_for(self, table: Table) -> "_TableJSON":
        """This JSON as that of ``table``, a copy of this one's table (``Table.origin``)."""
        return _TableJSON(table, list(self.versions), list(self.texts), list(self.digests),
                          self.whole, self.refs, [dict(v) for v in self.values],
                          [dict(e) for e in self.entries])


class Codec:
    def __init__(self, *registered: type, max_bytes: int = 64 * 2**20):
        self.types = {t.__name__: t for t in registered}
        if len(self.types) != len(registered):
            raise ValueError("two registered types share a name")
        self.max_bytes = max_bytes
        self._hints: dict[type, dict] = {}
        self._encoders: dict[type, typing.Callable] = {}
        # id -> its table's JSON as the last dumps wrote it
        self._tables: dict[int, _TableJSON] = {}
        self._seen: dict[int, _TableJSON] = {}
        self._parts: list[str] | None = None     # in a dumps: each placeholder's table JSON
        self._out: dict[str, str] | None = None  # in a dumps with parts: digest -> JSON
        self._part_min = 0                       # ... of tables of at least these bytes
        self._fetched: dict[str, str] = {}       # in a loads: the parts fetched
        self._nonce = ""
        self._marks: list[str] = []              # in a dumps: _values_json's keys

    # --- writing ------------------------------------------------------------------------------
    def dumps(self, obj, parts: dict[str, str] | None = None, part_min_bytes: int = 0) -> str:
        """The JSON text of ``obj``. With ``parts`` (a dict, filled here): each table whose
        JSON is at least ``part_min_bytes`` long is written as its parts' digests, and
        ``parts`` gets every part the text names (digest -> JSON)."""
        # each Table in the tree becomes a placeholder string, replaced in the text by the
        # table's JSON (kept from an earlier dumps while the table did not change). The
        # placeholder holds a random nonce: no string of the state (a worker's error
        # message) can be taken for one
        self._nonce, self._parts, self._seen = secrets.token_hex(16), [], {}
        self._marks = []
        self._out, self._part_min = parts, part_min_bytes
        try:
            text = _json(self.encode(obj))
            if self._parts:                   # one pass over the text, not one a table
                pieces = text.split(f'"table:{self._nonce}:')
                out = [pieces[0]]
                for piece in pieces[1:]:
                    index, rest = piece.split('"', 1)
                    out += (self._parts[int(index)], rest)
                text = "".join(out)
        finally:
            self._parts = self._out = None
        # the tables of this state only (a strong reference each: an id is not reused
        # while its entry is kept)
        self._tables, self._seen = self._seen, {}
        return text

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
        if issubclass(cls, Table):
            return self._encode_table
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

    def _encode_table(self, obj: Table):
        if self._parts is None:                    # encode() outside a dumps
            return {"__table__": self._encode_dict(obj)}
        hit = self._tables.get(id(obj))
        if hit is None or hit.table is not obj:
            hit = self._origin_json(obj) or _TableJSON(obj)
        versions, texts, digests = hit.versions, hit.texts, hit.digests
        parts, self._parts = self._parts, None     # a table inside one is written inline
        out, self._out = self._out, None
        try:
            for i, keys in enumerate(obj.shards):
                if versions[i] != obj.versions[i]:
                    hit.values[i], hit.entries[i] = self._entries(
                        obj, sorted(keys), hit.values[i], hit.entries[i])
                    texts[i] = ",".join(hit.entries[i].values())
                    versions[i] = obj.versions[i]
                    digests[i] = hit.whole = hit.refs = None
        finally:
            self._parts, self._out = parts, out
        self._seen[id(obj)] = hit
        if out is not None and sum(map(len, texts)) >= self._part_min:
            if hit.refs is None:
                for i, text in enumerate(texts):
                    if text and digests[i] is None:
                        digests[i] = part_digest(text)
                hit.refs = '{"__table__":{"__parts__":[' + ",".join(
                    f'"{d}"' for d in digests if d is not None) + "]}}"
            for text, digest in zip(texts, digests):
                if text:
                    out[digest] = text
            self._parts.append(hit.refs)
        else:
            if hit.whole is None:
                hit.whole = '{"__table__":{' + ",".join(t for t in texts if t) + "}}"
            self._parts.append(hit.whole)
        return f"table:{self._nonce}:{len(self._parts) - 1}"

    def _origin_json(self, obj: Table) -> _TableJSON | None:
        """The JSON the last ``dumps`` wrote of the table ``obj`` is a copy of, as
        ``obj``'s (a new membership at each migration and recovery: its tables encoded
        whole again were 30-70 ms a save at 4K workers)."""
        source = obj.origin() if obj.origin is not None else None
        hit = None if source is None else self._tables.get(id(source))
        return hit.copy_for(obj) if hit is not None and hit.table is source else None

    def _entries(self, table: Table, keys: list, before: dict,
                 written: dict) -> tuple[dict, dict]:
        """A part's values and entries (``_TableJSON``), in key order (as json's sort_keys
        writes them), each entry kept from ``written`` while its value is the object
        ``before`` holds."""
        values = [table[key] for key in keys]
        fresh = [i for i, (key, value) in enumerate(zip(keys, values, strict=True))
                 if before.get(key) is not value or key not in written]
        bad = [keys[i] for i in fresh
               if not isinstance(keys[i], str) or keys[i].startswith("__")]
        if bad:
            raise SnapshotError(f"dict key {bad[0]!r}: keys must be strings not starting "
                                f"with '__'")
        texts = [written.get(key) for key in keys] if len(fresh) < len(keys) else \
            [None] * len(keys)
        for i, text in zip(fresh, self._values_json([values[i] for i in fresh]), strict=True):
            texts[i] = f"{_key_json(keys[i])}:{text}"
        return dict(zip(keys, values, strict=True)), dict(zip(keys, texts, strict=True))

    def _values_json(self, values: list) -> list[str]:
        """Each value's JSON, from one encoder call (one a value cost twice as much on a
        table's first save): the values as an object under numbered keys that hold this
        dump's nonce, which no value's text can hold, split at those keys."""
        if len(values) < 2:
            return [_json(self.encode(v)) for v in values]
        marks = self._marks            # this dump's numbered keys, made once
        if len(marks) < len(values):
            marks += [f"{self._nonce}:{i:08d}" for i in range(len(marks), len(values))]
        text = _json(dict(zip(marks, map(self.encode, values))))
        pieces = text[1:-1].split(f'"{self._nonce}:')[1:]
        # each piece: 8 digits, '":', the value's JSON, and a comma but after the last
        return [piece[10:-1] for piece in pieces[:-1]] + [pieces[-1][10:]]

    def _check_registered(self, cls: type) -> None:
        if self.types.get(cls.__name__) is not cls:
            raise SnapshotError(f"type {cls.__name__} is not registered with this codec")

    # --- reading ------------------------------------------------------------------------------
    def loads(self, text: str | bytes,
              fetch: typing.Callable[[list[str]], dict[str, str | bytes]] | None = None):
        """The value of a ``dumps`` text. ``fetch``: digests -> the parts of those that it
        has (a text that names parts needs it; each part is checked against its digest)."""
        if len(text) > self.max_bytes:
            raise SnapshotError(f"snapshot of {len(text)} bytes exceeds {self.max_bytes}")
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise SnapshotError(f"not JSON: {exc}") from exc
        refs: list[str] = []
        if (b'"__parts__"' if isinstance(text, bytes) else '"__parts__"') in text:
            _part_refs(data, refs)      # (a walk of a whole tree: only where one may be)
        if refs and fetch is None:
            raise SnapshotError(f"the text names {len(refs)} table part(s) and no source "
                                f"of parts was given")
        self._fetched = {}
        if refs:
            size = len(text)
            for digest, part in fetch(refs).items():
                part = part.decode() if isinstance(part, bytes) else part
                size += len(part)
                if size > self.max_bytes:
                    raise SnapshotError(f"snapshot with its parts exceeds {self.max_bytes} "
                                        f"bytes")
                if part_digest(part) != digest:
                    raise SnapshotError(f"table part {digest} does not match its digest")
                self._fetched[digest] = part
        try:
            return self.decode(data)
        finally:
            self._fetched = {}

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
        if "__table__" in data:
            if not isinstance(data["__table__"], dict):
                raise SnapshotError("a table that is no object")
            if "__parts__" in data["__table__"]:
                return Table(self.decode(self._assembled(data["__table__"]["__parts__"])))
            return Table(self.decode(data["__table__"]))
        return {k: self.decode(v) for k, v in data.items()}

    def _assembled(self, digests: list[str]) -> dict:
        """A table's entries from its parts (fetched and checked by ``loads``)."""
        texts = []
        for digest in digests:
            if digest not in self._fetched:
                raise SnapshotError(f"table part {digest} is missing")
            texts.append(self._fetched[digest])
        try:
            entries = json.loads("{" + ",".join(texts) + "}")
        except ValueError as exc:
            raise SnapshotError(f"table parts that are no JSON object: {exc}") from exc
        if any(k.startswith("__") for k in entries):
            raise SnapshotError("a table part with a reserved key")
        return entries

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


def _part_refs(data, out: list[str]) -> None:
    """The part digests a decoded JSON tree names, in order (each checked for form)."""
    if isinstance(data, list):
        for v in data:
            _part_refs(v, out)
    elif isinstance(data, dict):
        table = data.get("__table__")
        if isinstance(table, dict) and "__parts__" in table:
            digests = table["__parts__"]
            if set(table) != {"__parts__"} or not isinstance(digests, list) or not all(
                    isinstance(d, str) and _DIGEST.fullmatch(d) for d in digests):
                raise SnapshotError("a table's parts that are not a list of digests")
            out += digests
            return
        for v in data.values():
            _part_refs(v, out)


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
