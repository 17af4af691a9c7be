"""Property-based: no input read from the store makes a reader fail other than with
``MessageError`` (a refusal the reader logs), and the MAC refuses every altered value."""
import json

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from trainmover.core import protocol as P
from trainmover.core.auth import AuthError, seal, unseal

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner,
                                                                max_size=4),
    max_leaves=20)

MESSAGE_TYPES = [P.StandbyReport, P.FailureReport, P.ReadyReport, P.SwitchReport,
                 P.MigrationAsk, P.StepEnds, P.ProcRecord, P.ExitRecord, P.ControllerInfo, P.AgentInfo,
                 P.HostBeat, P.HostPerf, P.StepPerf, P.HostReports,
                 P.HostRecovered]
READERS = [("command", P.decode_command, tuple(P.COMMANDS.values())),
           ("agent request", P.decode_agent_request, tuple(P.AGENT_REQUESTS.values()))] + \
          [(cls.__name__, (lambda c: lambda raw: P.read_message(c, raw))(cls), (cls,))
           for cls in MESSAGE_TYPES]


def _only_refusals(read, raw, types):
    try:
        out = read(raw)
    except P.MessageError:
        return
    assert isinstance(out, types)


@pytest.mark.parametrize("name, read, types", READERS, ids=[r[0] for r in READERS])
@settings(max_examples=150, deadline=None)
@given(raw=st.binary(max_size=200))
def test_arbitrary_bytes_are_refused_or_read(name, read, types, raw):
    _only_refusals(read, raw, types)


@pytest.mark.parametrize("name, read, types", READERS, ids=[r[0] for r in READERS])
@settings(max_examples=150, deadline=None)
@given(body=st.dictionaries(st.text(max_size=16), json_values, max_size=8),
       tag=st.sampled_from(sorted(P.COMMANDS) + sorted(P.AGENT_REQUESTS) + ["", "x"]) | json_values)
def test_arbitrary_json_objects_are_refused_or_read(name, read, types, body, tag):
    _only_refusals(read, json.dumps({**body, "type": tag}), types)
    _only_refusals(read, json.dumps(body), types)


@pytest.mark.parametrize("tag", [[], {}, ["spawn"], {"spawn": 1}, 1.5, None, True])
def test_a_type_tag_that_is_not_a_string_is_refused(tag):
    # Found by the property test above: an unhashable tag crashed the reader.
    for read in (P.decode_command, P.decode_agent_request):
        with pytest.raises(P.MessageError, match="unknown"):
            read(json.dumps({"type": tag}))


@settings(max_examples=200, deadline=None)
@given(key=st.text(min_size=1, max_size=30), payload=st.binary(max_size=100),
       secret=st.binary(min_size=32, max_size=64), data=st.data())
def test_the_mac_refuses_any_altered_value_key_or_secret(key, payload, secret, data):
    sealed = seal(secret, key, payload)
    assert unseal(secret, key, sealed) == payload
    i = data.draw(st.integers(0, len(sealed) - 1))
    flipped = sealed[:i] + bytes([sealed[i] ^ data.draw(st.integers(1, 255))]) + sealed[i + 1:]
    with pytest.raises(AuthError):
        unseal(secret, key, flipped)
    with pytest.raises(AuthError):
        unseal(secret, key + "/1", sealed)                # replayed at another key
    other = data.draw(st.binary(min_size=32, max_size=64).filter(lambda s: s != secret))
    with pytest.raises(AuthError):
        unseal(other, key, sealed)


@settings(max_examples=150, deadline=None)
@given(raw=st.binary(max_size=120))
def test_arbitrary_store_values_are_refused_or_authentic(raw):
    try:
        unseal(b"k" * 64, "agent/req/1", raw)
    except AuthError:
        return
    assert raw.startswith(b"tm1:")


HINTS = [int, float, str, bool, int | None, float | None, str | None, list[int],
         dict[str, float], list[P.PerfWindow], P.PerfWindow | None, dict[str, P.StepPerf],
         list[str] | None]


def _outcome(check, value):
    try:
        return "ok", check(value, ("Msg", "field"))
    except P.MessageError as exc:
        return "error", str(exc)


@pytest.mark.parametrize("hint", HINTS, ids=[str(h) for h in HINTS])
@settings(max_examples=150, deadline=None)
@given(value=json_values | st.fixed_dictionaries(
    {"first_step": st.integers(), "last_step": st.integers() | st.booleans(),
     "compute_s": st.floats(allow_nan=False) | st.integers() | st.none()}))
def test_the_readers_shortcut_gives_what_the_general_check_gives(hint, value):
    """A field's check tries the common case first (``protocol._shortcut``): for any
    value, the same value read, or the same error, as the general check alone."""
    got, want = _outcome(P._checker(hint), value), _outcome(P._make_checker(hint), value)
    assert got == want and type(got[1]) is type(want[1])


# strings the messages' own checks take (states, signals, sources, process names), drawn
# beside any text so that most drawn messages are ones a writer can make
WORDS = st.sampled_from(sorted({*P.STANDBY_STATES, *P.AGENT_SIGNALS, "replica", "snapshot",
                                "checkpoint", "w0", "s1", "dp0.pp1.tp0"})) | st.text(max_size=10)


def _made(cls):
    """A strategy of ``cls`` instances from its type hints (values its checks refuse are
    passed over)."""
    import typing

    def make(**kwargs):
        try:
            return cls(**kwargs)
        except P.MessageError:
            return None

    def strategy(hint):
        return WORDS if hint is str else st.from_type(hint)
    return st.builds(make, **{name: strategy(hint)
                              for name, hint in typing.get_type_hints(cls).items()})


# nested messages with checks of their own (a recovery's StateSource) drawn the same way
for _cls in (P.StateSource, P.StandbyReport):
    st.register_type_strategy(_cls, _made(_cls).filter(lambda m: m is not None))

WRITTEN = [(cls, P.write_message) for cls in MESSAGE_TYPES] + \
    [(cls, P.encode_command) for cls in P.COMMANDS.values()] + \
    [(cls, P.encode_agent_request) for cls in P.AGENT_REQUESTS.values()]


@pytest.mark.parametrize("cls, write", WRITTEN, ids=[c.__name__ for c, _ in WRITTEN])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(data=st.data())
def test_a_message_is_written_as_dataclasses_asdict_would_write_it(cls, write, data):
    """The writer skips ``asdict``'s copies, not a field: the same JSON as through it."""
    import dataclasses

    from hypothesis import assume

    msg = data.draw(_made(cls))
    assume(msg is not None)
    fields = dataclasses.asdict(msg)
    if write is not P.write_message:
        tag = next(name for name, c in {**P.COMMANDS, **P.AGENT_REQUESTS}.items() if c is cls)
        fields = {"type": tag, **fields}
    assert write(msg) == json.dumps(fields, sort_keys=True)
