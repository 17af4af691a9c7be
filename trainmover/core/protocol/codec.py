"""Messages as JSON: written from a dataclass's fields, read back checked against its
type hints (``MessageError`` for anything the protocol does not define)."""
from __future__ import annotations

import dataclasses
import json
import types
import typing

def encode(obj) -> str:
    """JSON for a value whose shape the protocol does not fix: the controller's answers to
    a ``trainmover migrate`` caller (read by a person), a step's metrics record."""
    return json.dumps(obj, sort_keys=True)


# --- messages -------------------------------------------------------------------------------
# Everything that crosses a process boundary through the store is a dataclass written as JSON
# and validated when read: an unknown type or field, a field of the wrong type or an
# oversized message is refused with ``MessageError`` (the reader logs it and goes on, never
# half-obeys it and never dies of it). Keys name their message type (``standby/<w>/state``
# holds a ``StandbyReport``); lists of orders (worker commands, agent requests) carry a
# ``type`` tag.

MAX_MESSAGE_BYTES = 256 * 1024


class MessageError(ValueError):
    """A message that is not one the protocol defines."""


def write_message(msg) -> str:
    return json.dumps(msg, default=json_fields, sort_keys=True)


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def json_fields(obj) -> dict:
    """json's ``default`` for a dataclass: its fields, whose values json encodes itself
    (``dataclasses.asdict`` deep-copies every leaf first: 8.5 us a host's beat, 56 us a
    window's step measurements, written by every agent every beat)."""
    names = _FIELD_NAMES.get(type(obj))
    if names is None:
        if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
            raise TypeError(f"{type(obj).__name__} is not JSON")
        names = _FIELD_NAMES[type(obj)] = tuple(f.name for f in dataclasses.fields(obj))
    return {name: getattr(obj, name) for name in names}


def read_message(cls, raw: bytes | str):
    """``raw`` as a ``cls``, or ``MessageError``."""
    return _build(cls, _parse(cls.__name__, raw))


def read_object(raw: bytes | str) -> dict:
    """A JSON object of free shape (a metrics record), size-checked."""
    data = _parse("record", raw)
    if not isinstance(data, dict):
        raise MessageError(f"record: expected an object, got {type(data).__name__}")
    return data


def _parse(what: str, raw: bytes | str):
    if len(raw) > MAX_MESSAGE_BYTES:
        raise MessageError(f"{what} of {len(raw)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise MessageError(f"{what} is not JSON: {exc}") from exc


def _tagged(registry: dict, kind: str):
    names = {cls: name for name, cls in registry.items()}

    def write(msg) -> str:
        return json.dumps({"type": names[type(msg)], **json_fields(msg)}, default=json_fields,
                          sort_keys=True)

    def read(raw: bytes | str):
        data = _parse(kind, raw)
        tag = data.get("type") if isinstance(data, dict) else data
        # A forged tag may be any JSON value, lists and objects included: only
        # a string can name a message type (and a list cannot even be looked up).
        if not isinstance(tag, str) or tag not in registry:
            raise MessageError(f"unknown {kind} type {tag!r}")
        return _build(registry[data.pop("type")], data)

    return write, read


_HINTS: dict[type, dict] = {}


def _type_hints(cls) -> dict:
    """``typing.get_type_hints(cls)``, once per class: it cost most of a message's read
    (tens of microseconds), which the controller pays per worker every health check."""
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls)
    return hints


def _build(cls, data):
    return _builder(cls)(data)


# What reads a message: one function per message class and per field type, made at the
# first read of it. Each read used to ask typing for every field's options again and format
# every field's place in the message for an error it would not raise: the controller reads a
# report per survivor in a recovery (90 us a FailureReport here, against 9 us to parse it).
_BUILDERS: dict[type, typing.Callable] = {}
_CHECKERS: dict = {}


def _builder(cls) -> typing.Callable:
    """``build(data) -> cls``: raises ``MessageError`` naming the bad field."""
    build = _BUILDERS.get(cls)
    if build is not None:
        return build
    name_of = cls.__name__
    # each field's check and its place, for an error
    checks = {name: (_checker(hint), (name_of, name))
              for name, hint in _type_hints(cls).items()}

    def build(data):
        if not isinstance(data, dict):
            raise MessageError(f"{name_of}: expected an object, got {data!r}")
        values = {}
        for name, value in data.items():
            field = checks.get(name)
            if field is None:
                unknown = sorted(set(data) - set(checks))
                raise MessageError(f"{name_of}: unknown field(s) {unknown}")
            values[name] = field[0](value, field[1])
        try:
            return cls(**values)
        except TypeError as exc:
            raise MessageError(f"{name_of}: {exc}") from exc

    _BUILDERS[cls] = build
    return build


def _where(path: tuple) -> str:
    """A value's place in a message, formatted only for an error: ``(class, field)``, or
    ``(parent, part)`` with part a list index, a dict key, or None for a dict's key itself."""
    if isinstance(path[0], str):
        return f"{path[0]}.{path[1]}"
    parent, part = path
    if part is None:
        return f"{_where(parent)} key"
    return f"{_where(parent)}[{part}]" if isinstance(part, int) else \
        f"{_where(parent)}[{part!r}]"


def _checker(hint) -> typing.Callable:
    """``check(value, path)``: ``value`` as ``hint`` says: int, float, str, bool, ``list[X]``,
    ``dict[str, X]``, a message dataclass, ``typing.Any`` (any JSON value), or a union of
    these (with None); ``path`` names its place for the error (``_where``)."""
    check = _CHECKERS.get(hint)
    if check is None:
        check = _CHECKERS[hint] = _shortcut(hint, _make_checker(hint))
    return check


def _shortcut(hint, check) -> typing.Callable:
    """``check``, first trying the common case directly: a value of the exact type ``hint``
    names (or None where it allows None), which ``check`` would return as it is (a float
    as a float, an int as an int: JSON gives no subclasses but bool, which ``int`` refuses
    either way), and a message dataclass's object, built by its builder, looked up once.
    Anything else goes to ``check``, with the same result and the same errors. Reading a
    host's ``HostPerf`` (8 workers' windows) spent most of its time in the general path."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    nullable = type(None) in options
    rest = [o for o in options if o is not type(None)]
    if len(rest) != 1:
        return check
    (opt,) = rest
    if opt in (int, float, str, bool):
        def simple(value, path, exact=opt):
            if type(value) is exact or (value is None and nullable):
                return value
            return check(value, path)
        return simple
    if dataclasses.is_dataclass(opt):
        built: list = []      # its builder, looked up at the first value (it may be this one)

        def message(value, path):
            if type(value) is dict:
                if not built:
                    built.append(_builder(opt))
                return built[0](value)
            if value is None and nullable:
                return None
            return check(value, path)
        return message
    origin = typing.get_origin(opt)
    if origin in (list, dict):
        convert = _list_of(typing.get_args(opt)[0]) if origin is list else \
            _dict_of(typing.get_args(opt)[1])

        def container(value, path):
            if type(value) is origin:
                return convert(value, path)
            if value is None and nullable:
                return None
            return check(value, path)
        return container
    return check


def _make_checker(hint) -> typing.Callable:
    if hint is typing.Any:
        return lambda value, path: value
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    nullable = type(None) in options
    tests = []   # (accepts(value), convert(value, path) or None: as is), the union's order
    for opt in options:
        origin = typing.get_origin(opt)
        if opt is int:
            tests.append((lambda v: isinstance(v, int) and not isinstance(v, bool), None))
        elif opt is float:
            tests.append((lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
                          lambda v, path: float(v)))
        elif opt in (str, bool):
            tests.append((lambda v, opt=opt: isinstance(v, opt), None))
        elif origin is list:
            (item,) = typing.get_args(opt)
            tests.append((lambda v: isinstance(v, list), _list_of(item)))
        elif origin is dict:
            _, item = typing.get_args(opt)
            tests.append((lambda v: isinstance(v, dict), _dict_of(item)))
        elif dataclasses.is_dataclass(opt):
            tests.append((lambda v: isinstance(v, dict),
                          lambda v, path, opt=opt: _builder(opt)(v)))

    def check(value, path):
        for accepts, convert in tests:     # none accepts None
            if accepts(value):
                return value if convert is None else convert(value, path)
        if value is None:
            if nullable:
                return None
            raise MessageError(f"{_where(path)} may not be null")
        raise MessageError(f"{_where(path)}: {value!r} is not a {hint}")

    return check


def _list_of(item_hint) -> typing.Callable:
    def convert(value: list, path: tuple) -> list:
        item = _checker(item_hint)
        return [item(v, (path, i)) for i, v in enumerate(value)]
    return convert


def _dict_of(item_hint) -> typing.Callable:
    def convert(value: dict, path: tuple) -> dict:
        key, item = _checker(str), _checker(item_hint)
        return {key(k, (path, None)): item(v, (path, k)) for k, v in value.items()}
    return convert
