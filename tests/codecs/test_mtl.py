"""Tests for `gateway.codecs.mtl`: control requests and replies, data commands.

Headers written by hand from the spec's field lists, the spec's JSON
examples (its 202 example is not valid JSON and is refused as such),
hypothesis round trips of every data command, and ill-formed input.
"""

from __future__ import annotations

import contextlib
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.codecs import mtl


def test_control_requests_from_the_spec() -> None:
    """Command names in any case; bodies are JSON objects; anything else is dropped."""
    body = b'{"protocol": {"name": "MTL", "version": 1}, "virtual-host": "test-env"}'
    request = mtl.parse_request([b"Connection.OPEN", body])
    assert request == mtl.ControlRequest(
        "connection.open", {"protocol": {"name": "MTL", "version": 1}, "virtual-host": "test-env"}
    )
    spec_202 = b'{"status": "Data Lease", "port": port number "lease" : "data lease"}'
    for frames in ([b"Connection.Open"], [b"a", b"{}", b"c"], [b"x", b"not json"], [b"x", spec_202],
                   [b"x", b"[1, 2]"], [b"\xff", b"{}"]):  # fmt: skip
        assert mtl.parse_request(frames) is None


def test_replies() -> None:
    """Three digits, then the JSON body (valid JSON, unlike the spec's 202 example)."""
    status, body = mtl.reply(202, {"status": "Data Lease", "port": 5556, "lease": "L"})
    assert status == b"202"
    assert json.loads(body) == {"status": "Data Lease", "port": 5556, "lease": "L"}


def test_headers_by_hand() -> None:
    """Each command's header from the spec's field list."""
    seq = b"\x00\x00\x00\x00\x00\x00\x00\x07"
    assert mtl.encode_data(mtl.Lease(7, "abc")) == [b"\x01" + seq + b"\x03abc", b""]
    assert mtl.encode_data(mtl.Response(7, 403)) == [b"\x02" + seq, b"403"]
    assert mtl.encode_data(mtl.Summon(7, "resource")) == [b"\x03" + seq + b"\x08resource", b""]
    assert mtl.encode_data(mtl.Dismiss(7, "r")) == [b"\x04" + seq + b"\x01r", b""]
    assert mtl.encode_data(mtl.Content(7, "", {}, b"hi")) == [
        b"\x05" + seq + b"\x00" + b"\x00\x00\x00\x00",
        b"hi",
    ]
    assert mtl.encode_data(mtl.Confirm(7, True)) == [b"\x06" + seq + b"\x01", b""]
    assert mtl.encode_data(mtl.Reject(7, False, True)) == [b"\x07" + seq + b"\x00\x01", b""]
    assert mtl.encode_data(mtl.Ping()) == [b"\x08", b""]
    assert mtl.encode_data(mtl.Pong()) == [b"\x09", b""]


sequences = st.integers(0, 2**64 - 1)
names = st.text(max_size=30).filter(lambda t: len(t.encode()) <= 255)
values = st.none() | st.booleans() | st.integers(0, 2**40) | names
commands = st.one_of(
    st.builds(mtl.Lease, sequences, names),
    st.builds(mtl.Response, sequences, st.integers(100, 599)),
    st.builds(mtl.Summon, sequences, names),
    st.builds(mtl.Dismiss, sequences, names),
    st.builds(
        mtl.Content,
        sequences,
        names,
        st.dictionaries(
            names, st.none() | st.booleans() | st.integers(0, 2**40) | names, max_size=3
        ),
        st.binary(max_size=64),
    ),
    st.builds(mtl.Confirm, sequences, st.booleans()),
    st.builds(mtl.Reject, sequences, st.booleans(), st.booleans()),
    st.just(mtl.Ping()),
    st.just(mtl.Pong()),
)


@given(commands)
def test_round_trip(command: mtl.DataCommand) -> None:
    """Every data command decodes to itself."""
    assert mtl.decode_data(mtl.encode_data(command)) == command


def test_deeply_nested_json_is_ill_formed_and_dropped() -> None:
    """A body nesting past MAX_JSON_DEPTH is dropped like invalid JSON, never a RecursionError."""
    assert mtl.parse_request([b"connection.open", b"[" * 200_000]) is None
    deep = b'{"a": ' + b"[" * (mtl.MAX_JSON_DEPTH + 1) + b"]" * (mtl.MAX_JSON_DEPTH + 1) + b"}"
    assert mtl.parse_request([b"connection.open", deep]) is None
    within = b'{"a": ' + b"[" * (mtl.MAX_JSON_DEPTH - 1) + b"]" * (mtl.MAX_JSON_DEPTH - 1) + b"}"
    assert mtl.parse_request([b"connection.open", within]) is not None


def test_brackets_inside_strings_do_not_count_as_nesting() -> None:
    """Only structure nests: a string full of brackets (and escaped quotes) is fine."""
    body = json.dumps({"a": '\\"[{' * 100, "b": [[1]]}).encode()
    request = mtl.parse_request([b"connection.open", body])
    assert request is not None and request.body["b"] == [[1]]


json_texts = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet="[]{}\\\"ab", max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=60,
)


@given(json_texts)
def test_depth_check_agrees_with_the_structure(value: object) -> None:
    """json_depth_within measures the real nesting of any JSON value."""

    def depth(v: object) -> int:
        if isinstance(v, list):
            return 1 + max((depth(x) for x in v), default=0)
        if isinstance(v, dict):
            return 1 + max((depth(x) for x in v.values()), default=0)
        return 0

    data = json.dumps(value).encode()
    for limit in (0, 1, 2, 5):
        assert mtl.json_depth_within(data, limit) == (depth(value) <= limit)


@given(st.lists(st.binary(max_size=60), max_size=3))
def test_arbitrary_control_frames_parse_or_are_dropped(frames: list[bytes]) -> None:
    """Any frames give a request or None (dropped); no other exception escapes."""
    request = mtl.parse_request(frames)
    assert request is None or isinstance(request.body, dict)


@given(st.lists(st.binary(max_size=40), max_size=3))
def test_garbage_raises_only_mtl_errors(frames: list[bytes]) -> None:
    """Arbitrary frames decode or raise MTLError."""
    with contextlib.suppress(mtl.MTLError):
        mtl.decode_data(frames)


def test_ill_formed_data_commands() -> None:
    """Wrong frame counts, unknown types, cut fields, trailing bytes, bad booleans."""
    seq = b"\x00" * 8
    for frames in ([b"\x08"], [b"\x08", b"", b""], [b"\x0a", b""], [b"\x01\x00", b""],
                   [b"\x08x", b""], [b"\x06" + seq + b"\x02", b""], [b"\x02" + seq, b"20"],
                   [b"", b""]):  # fmt: skip
        with pytest.raises(mtl.MTLError):
            mtl.decode_data(frames)
    with pytest.raises(mtl.MTLLocalError):
        mtl.encode_data(mtl.Summon(-1, "x"))


# The spec's JSON examples, as printed ("Client Authentication" to "Requesting a
# Data Lease"), with the placeholders it leaves in them.
SPEC_REQUESTS = {
    b"Connection.Open": (
        b'{\n    "protocol": {\n        "name": "MTL",\n        "version": 1\n    },\n'
        b'    "virtual-host": "test-env"\n}'
    ),
    b"Connection.Authorize": (
        b'{\n    "mechanism" : "mechanism name",\n    "response" : "BASE64-encoded blob"\n}'
    ),
    b"Connection.Profile": b'{\n    "profile" : "profile name"\n}',
    b"Connection.Reader": (
        b'{\n    "resources": [ "resource name", "resource name", ...],\n'
        b'    "confirm": "none | full"\n}'
    ),
    b"Connection.Writer": (
        b'{\n    "resources": [ "resource name", "resource name"],\n    "confirm": "none | full"\n}'
    ),
}
SPEC_REPLIES = {
    b"201": b'{\n    "status": "Ready",\n    "profiles": [ "profile name", "profile name"]\n}',
    b"401": b'{\n    "status": "Unauthorized",\n    "mechanisms": [ "mechanism name"]\n}',
    b"402": (
        b'{\n    "status": "Challenged",\n    "mechanism": "mechanism name",\n'
        b'    "challenge" : "BASE64-encoded blob"\n}'
    ),
    b"200": b'{\n    "status": "OK"\n}',
    b"202": (
        b'{\n    "status": "Data Lease",\n    "port": port number\n    "lease" : "data lease"\n}'
    ),
    b"501": b'{\n    "status": "Not implemented"\n}',
}


def test_every_spec_request_example() -> None:
    """Each request example parses, except the Reader one whose ``...`` is not JSON."""
    parsed = {name: mtl.parse_request([name, body]) for name, body in SPEC_REQUESTS.items()}
    assert parsed[b"Connection.Reader"] is None  # `...` in a list: dropped as ill-formed
    assert parsed[b"Connection.Open"] == mtl.ControlRequest(
        "connection.open", {"protocol": {"name": "MTL", "version": 1}, "virtual-host": "test-env"}
    )
    assert parsed[b"Connection.Authorize"] == mtl.ControlRequest(
        "connection.authorize", {"mechanism": "mechanism name", "response": "BASE64-encoded blob"}
    )
    assert parsed[b"Connection.Profile"] == mtl.ControlRequest(
        "connection.profile", {"profile": "profile name"}
    )
    assert parsed[b"Connection.Writer"] == mtl.ControlRequest(
        "connection.writer",
        {"resources": ["resource name", "resource name"], "confirm": "none | full"},
    )
    for name, body in SPEC_REQUESTS.items():
        request = mtl.parse_request([name, body])
        if request is not None:  # our encoder says the same thing
            assert mtl.parse_request(mtl.request(name.decode(), request.body)) == request


def test_every_spec_reply_example() -> None:
    """Each reply example parses (202 is not JSON: we send valid JSON instead)."""
    parsed = {status: mtl.parse_reply([status, body]) for status, body in SPEC_REPLIES.items()}
    assert parsed[b"201"] == (201, {"status": "Ready", "profiles": ["profile name"] * 2})
    assert parsed[b"401"] == (401, {"status": "Unauthorized", "mechanisms": ["mechanism name"]})
    assert parsed[b"402"] == (
        402,
        {"status": "Challenged", "mechanism": "mechanism name", "challenge": "BASE64-encoded blob"},
    )
    assert parsed[b"200"] == (200, {"status": "OK"})
    assert parsed[b"501"] == (501, {"status": "Not implemented"})
    assert parsed[b"202"] is None
    ours = {"status": "Data Lease", "port": 5556, "lease": "data lease"}
    assert mtl.parse_reply(mtl.reply(202, ours)) == (202, ours)
    for frames in ([b"20", b"{}"], [b"2x1", b"{}"], [b"201"], [b"201", b"[]"]):
        assert mtl.parse_reply(frames) is None


def test_field_encodings_by_hand() -> None:
    """Integer 8 bytes, shortint 2 bytes (network order), boolean 0 or 1."""
    assert mtl.encode_integer(2**64 - 1) == b"\xff" * 8
    assert mtl.encode_integer(258) == b"\0" * 6 + b"\x01\x02"
    assert mtl.encode_shortint(258) == b"\x01\x02"
    assert mtl.encode_boolean(True) == b"\x01" and mtl.encode_boolean(False) == b"\x00"
    assert mtl.decode_shortint(b"x\x01\x02", 1) == (258, 3)
    assert mtl.decode_integer(b"\0" * 7 + b"\x05") == (5, 8)
    assert mtl.decode_boolean(b"\x00\x01", 1) == (True, 2)
    for bad in (-1, 2**16):
        with pytest.raises(mtl.MTLLocalError):
            mtl.encode_shortint(bad)
    with pytest.raises(mtl.MTLLocalError):
        mtl.encode_integer(2**64)
    for decode, data in ((mtl.decode_shortint, b"\x01"), (mtl.decode_integer, b"\0" * 7),
                         (mtl.decode_boolean, b""), (mtl.decode_boolean, b"\x02")):  # fmt: skip
        with pytest.raises(mtl.MTLError):
            decode(data, 0)  # type: ignore[operator]


@given(st.integers(0, 2**16 - 1), st.integers(0, 2**64 - 1), st.booleans())
def test_field_round_trips(shortint: int, integer: int, flag: bool) -> None:
    """Each field encoding decodes to itself, one after another in a buffer."""
    data = mtl.encode_shortint(shortint) + mtl.encode_integer(integer) + mtl.encode_boolean(flag)
    value, offset = mtl.decode_shortint(data)
    assert value == shortint
    value, offset = mtl.decode_integer(data, offset)
    assert value == integer
    assert mtl.decode_boolean(data, offset) == (flag, len(data))


def test_content_properties_are_an_amqp_field_table() -> None:
    """Properties use the AMQP 0-9-1 field table: 4-byte size, short-string keys, typed values."""
    header, body = mtl.encode_data(mtl.Content(1, "r", {"k": "v"}, b"x"))
    table = header[1 + 8 + 2 :]
    assert table == b"\x00\x00\x00\x08" + b"\x01k" + b"S\x00\x00\x00\x01v"
    assert mtl.decode_data([header, body]) == mtl.Content(1, "r", {"k": "v"}, b"x")
